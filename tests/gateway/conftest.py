"""The gateway tests' processes: one stack on the tiny checkpoint (code2wav, talker, thinker,
router), the gateway in front of it as its own process on a free loopback port, and the openai
SDK (sync and async) pointed at it over real HTTP.

Short defaults keep the suite fast: the thinker writes at most 12 tokens and the talker 24 frames
unless a request asks otherwise. Other gateways (towards an authenticating router with tight
admission limits, a dead router, a tiny deadline) start where a test module needs them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.tools.client import connect
from services.tools.launcher import Stack, StackOptions, free_port

THINKER_TOKENS = 12
TALKER_FRAMES = 24


@dataclass
class Gateway:
    popen: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def start_gateway(router: str, log_dir: Path, *args: str, timeout_s: float = 60.0) -> Gateway:
    """`python -m gateway.server` (this worktree's code) on a free port; returns once it answers."""
    port = free_port()
    log = log_dir / f"gateway-{port}.log"
    out = open(log, "w")
    popen = subprocess.Popen([sys.executable, "-m", "gateway.server", "--router", router, "--host", "127.0.0.1",
                              "--port", str(port), *args], stdout=out, stderr=subprocess.STDOUT,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    gateway = Gateway(popen, port, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"gateway exited with {popen.returncode}: {log.read_text()}")
        try:
            urllib.request.urlopen(f"{gateway.url}/v1/models", timeout=1).read()
            return gateway
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    gateway.stop()
    raise RuntimeError(f"gateway did not answer within {timeout_s} s: {log.read_text()}")


def start_router(stack: Stack, *args: str) -> tuple[subprocess.Popen, int]:
    """A second router over the same stage replicas (routers hold no model: they start in a second)."""
    port = free_port()
    routes = []
    for stage in ("thinker", "talker", "code2wav"):
        routes += [f"--{stage}", ",".join(stack.addresses(stage))]
    popen = subprocess.Popen([sys.executable, "-m", "router.server", "--host", "127.0.0.1", "--port", str(port),
                              "--poll-interval-s", "0.5", *routes, *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return popen, port


@pytest.fixture(scope="package")
def gw_stack(tiny_checkpoint):
    metrics_port = free_port()
    options = StackOptions(
        checkpoint=str(tiny_checkpoint), port=0, threads=1, log_prefix=False,
        thinker_args=("--default-max-new-tokens", str(THINKER_TOKENS)),
        talker_args=("--default-max-new-tokens", str(TALKER_FRAMES)),
        router_args=("--metrics-port", str(metrics_port)),
    )
    with Stack(options) as stack:
        stack.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield stack


@pytest.fixture(scope="package")
def gateway(gw_stack, tiny_checkpoint, tmp_path_factory):
    running = start_gateway(gw_stack.target, tmp_path_factory.mktemp("gateway"), "--checkpoint", str(tiny_checkpoint),
                            "--model-name", "tiny-qwen3-omni")
    yield running
    running.stop()


@pytest.fixture(scope="package")
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
