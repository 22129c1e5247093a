"""The sessions tests' processes: the end-to-end ones run on the stack tests/e2e shares (its
sessions service included: tests/conftest.py's `shared_stack`); tests/sessions/procs.py starts the
extra routers and sessions services a test needs of its own."""

from __future__ import annotations

import pytest

from services.tools.client import connect


@pytest.fixture(scope="session")
def stack(shared_stack):
    """code2wav, talker, thinker, router and sessions service as processes on loopback ports."""
    return shared_stack.stack


@pytest.fixture(scope="session")
def omni(stack):
    """A stub of the router's public API (the one-shot requests a turn is compared with)."""
    channel, stub = connect(stack.target)
    yield stub
    channel.close()
