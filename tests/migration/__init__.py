"""Tests of request migration: a stage replica dies mid-stream, the request moves and completes."""
