"""Tests of services/common: checkpoint, reference runner, wire format, protos."""
