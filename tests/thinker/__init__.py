"""Tests of services/thinker: the engine (continuous batching, exactness, cancellation)."""
