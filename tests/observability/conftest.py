"""The traced stack: every process of the pipeline (router, two thinker replicas, a talker, two
code2wav replicas, the HTTP gateway) exporting spans to a local OTLP collector in this process, logging JSON, with
Prometheus ports. Started once for the package (tests/stacks.py), by the slow tests only."""

from __future__ import annotations

import os

import pytest

from services.tools.launcher import free_port_block
from services.tools.otlp_sink import OtlpSink
from tests.stacks import stack_of

# The processes export their spans every 100 ms (OTEL_BSP_SCHEDULE_DELAY; 5 s by default).
EXPORT_DELAY_MS = "100"


@pytest.fixture(scope="package")
def collector():
    with OtlpSink() as sink:
        yield sink


@pytest.fixture(scope="package")
def traced_stack(tiny_checkpoint, collector):
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = EXPORT_DELAY_MS  # the children read it at start (and restart)
    metrics_port = free_port_block()  # the base and one port per process after it
    stack = stack_of(tiny_checkpoint, thinker_replicas=2, code2wav_replicas=2, http_port=0, metrics_base_port=metrics_port,
                     router_args=("--max-migrations", "2"),
                     extra_args=("--otlp-endpoint", collector.endpoint, "--log-format", "json"))
    try:
        with stack:
            # router: the base port; every other process the next ones, in start order (launcher.py)
            others = [name for name in stack.processes if name != "router"]
            stack.metrics_urls = {"router": f"http://127.0.0.1:{metrics_port}/metrics",
                                  **{name: f"http://127.0.0.1:{metrics_port + 1 + i}/metrics"
                                     for i, name in enumerate(others)}}
            yield stack
    finally:
        if saved is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved
