"""Fixtures that start real processes: the whole stack on the tiny checkpoint, once per session
(tests/conftest.py's `shared_stack`, which tests/hostile uses too)."""

from __future__ import annotations

import pytest

from services.tools.client import connect


@pytest.fixture(scope="session")
def stack(shared_stack):
    """code2wav, talker, thinker and router as four processes on loopback ports."""
    return shared_stack.stack


@pytest.fixture(scope="session")
def omni(stack):
    """A stub of the router's public API."""
    channel, stub = connect(stack.target)
    yield stub
    channel.close()


@pytest.fixture(scope="session")
def reference(tiny_checkpoint):
    """transformers' generate on the same checkpoint, in this process: the oracle."""
    import transformers

    from services.tools.reference import ReferenceRunner

    transformers.logging.set_verbosity_error()
    return ReferenceRunner(tiny_checkpoint)
