"""Tests of services/talker: the engine fed by streamed text (continuous batching, waiting, exactness)."""
