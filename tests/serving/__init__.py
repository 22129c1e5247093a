"""Tests of services/serving: error mapping, engine loop, stream relay, proto converters, servers in-process."""
