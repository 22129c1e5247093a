"""Starting the gateway (and extra routers) as real processes for the tests. (tests/gateway has
no __init__.py on purpose: a test package named `gateway` would shadow the real one.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.tools.launcher import Stack, free_port


@dataclass
class Gateway:
    popen: subprocess.Popen
    port: int
    log: Path | None  # its output (None: the launcher reads it)

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
            urllib.request.urlopen(f"{gateway.url}/live", timeout=1).read()  # a probe: open with tokens too
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
