"""The gateway tests' processes: one stack on the tiny checkpoint (code2wav, talker, thinker,
router), the gateway in front of it as its own process on a free loopback port, and the openai
SDK (sync and async) pointed at it over real HTTP.

Short defaults keep the suite fast: the thinker writes at most 12 tokens and the talker 24 frames
unless a request asks otherwise. Other gateways (towards an authenticating router with tight
admission limits, a dead router, a tiny deadline) start where a test module needs them.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import tool_replies
from gateway_procs import Gateway

from services.tools.client import connect
from services.tools.launcher import Stack, StackOptions, free_port
from tests.threads import torch_threads

THINKER_TOKENS = 12
TALKER_FRAMES = 24


@pytest.fixture(scope="session")
def gw_stack(tiny_checkpoint):
    """The stack, its thinker with the function-calling tests' scripted replies (tool_replies.py:
    only requests that hold one of their keys are changed)."""
    metrics_port = free_port()
    options = StackOptions(
        checkpoint=str(tiny_checkpoint), port=0, threads=torch_threads(1), log_prefix=False,
        thinker_args=("--default-max-new-tokens", str(THINKER_TOKENS)),
        talker_args=("--default-max-new-tokens", str(TALKER_FRAMES)),
        router_args=("--metrics-port", str(metrics_port)),
        http_port=0, gateway_args=("--model-name", "tiny-qwen3-omni"),  # the launcher starts the gateway too
    )
    with mock.patch.dict(os.environ, tool_replies.ENV), Stack(options) as stack:
        stack.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield stack


@pytest.fixture(scope="session")
def gateway(gw_stack):
    """The gateway `Stack` started (as `omni-serve up` does): --checkpoint gives it the voices."""
    process = gw_stack.processes["gateway"]
    return Gateway(process.popen, process.port, None)


@pytest.fixture(scope="session")
def omni(gw_stack):
    """The router's gRPC API, to compare the gateway's answers with."""
    channel, stub = connect(gw_stack.target)
    yield stub
    channel.close()


@pytest.fixture
def client(gateway):
    import openai

    with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def async_client(gateway):
    """A factory: AsyncOpenAI binds to the event loop it first runs on, so make it inside the
    coroutine (`asyncio.run` per test)."""
    import openai

    return lambda **kw: openai.AsyncOpenAI(**{"base_url": gateway.base_url, "api_key": "unused", "max_retries": 0,
                                              "timeout": 120, **kw})
