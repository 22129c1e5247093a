"""The hostile-input tests' stack: real processes, one replica per stage, tight input limits.

One stack serves the whole folder; the function-scoped `stack` fixture waits until every stage
holds nothing and every process is up and used by the router, so each test starts idle.
"""

from __future__ import annotations

import pytest

from services.tools.client import connect
from services.tools.launcher import free_port
from services.tools.soak import wait_settled
from tests.reliability.support import Reliable
from tests.stacks import stack_of

from .support import MAX_AUDIO_SECONDS, MAX_IMAGE_PIXELS, MAX_IN_FLIGHT, SETTLE_S


@pytest.fixture(scope="package")
def hostile(tiny_checkpoint):
    metrics_port = free_port()
    stack = stack_of(
        tiny_checkpoint,
        thinker_args=("--max-audio-seconds", str(MAX_AUDIO_SECONDS), "--max-image-pixels", str(MAX_IMAGE_PIXELS)),
        router_args=("--max-in-flight", str(MAX_IN_FLIGHT), "--max-queue", "64", "--metrics-port", str(metrics_port)),
    )
    with stack:
        yield Reliable(stack, f"http://127.0.0.1:{metrics_port}/metrics")


@pytest.fixture
def stack(hostile) -> Reliable:
    hostile.revive()
    settled = wait_settled(hostile.replicas, hostile.metrics_url, SETTLE_S)
    assert settled.idle, f"stack busy before the test: {settled.busy()}, router {settled.router}"
    return hostile


@pytest.fixture
def omni(stack):
    channel, stub = connect(stack.target)
    yield stub
    channel.close()
