"""The reliability tests' stack: real processes, two talker replicas, tight admission limits.

One stack serves the whole folder (starting one takes ~20 s on a 2-core machine). Tests kill,
drain and restart its replicas; the function-scoped `stack` fixture brings every process back
and waits until the router uses all of them and every stage holds nothing, so each test starts
from the same state whatever the one before it did.
"""

from __future__ import annotations

import pytest

from services.tools.client import connect
from services.tools.launcher import free_port
from services.tools.soak import wait_settled
from tests.stacks import stack_of

from .support import (
    MAX_IN_FLIGHT,
    MAX_QUEUE,
    QUEUE_TIMEOUT_S,
    SETTLE_S,
    TALKER_GRACE_S,
    Reliable,
)


@pytest.fixture(scope="package")
def reliable(tiny_checkpoint):
    metrics_port = free_port()
    stack = stack_of(
        tiny_checkpoint, talker_replicas=2, code2wav_replicas=1,
        talker_args=("--grace-s", str(TALKER_GRACE_S), "--drain-delay-s", "2"),  # the drain test
        router_args=("--max-in-flight", str(MAX_IN_FLIGHT), "--max-queue", str(MAX_QUEUE),
                     "--queue-timeout-s", str(QUEUE_TIMEOUT_S), "--metrics-port", str(metrics_port)),
    )
    with stack:
        yield Reliable(stack, f"http://127.0.0.1:{metrics_port}/metrics")


@pytest.fixture
def stack(reliable) -> Reliable:
    """The shared stack with every process up, used by the router, and idle."""
    reliable.revive()
    settled = wait_settled(reliable.replicas, reliable.metrics_url, SETTLE_S)
    assert settled.idle, f"stack busy before the test: {settled.busy()}, router {settled.router}"
    return reliable


@pytest.fixture
def omni(stack):
    """A stub of the router's public API (a channel of its own per test)."""
    channel, stub = connect(stack.target)
    yield stub
    channel.close()
