"""The hostile-input tests' stack: real processes, one replica per stage, tight input limits
(support.py), started once for this folder and tests/e2e (tests/conftest.py's `shared_stack`).

The function-scoped `stack` fixture waits until every stage holds nothing and every process is up
and used by the router, so each test starts idle.
"""

from __future__ import annotations

import pytest

from services.tools.client import connect
from services.tools.soak import wait_settled
from tests.reliability.support import Reliable

from .support import SETTLE_S


@pytest.fixture(scope="package")
def hostile(shared_stack) -> Reliable:
    return shared_stack


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
