"""Tests of services/tools: the omni-serve launcher as a user runs it."""
