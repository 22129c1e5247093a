"""What the reliability tests share besides fixtures: the stack's limits, its view, and how every
test ends (`assert_recovered`)."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

from services.tools.client import build_request
from services.tools.launcher import Stack
from services.tools.soak import STAGES, Call, read_router_gauges, wait_settled

MAX_IN_FLIGHT = 4  # router admission: requests streaming at once
MAX_QUEUE = 4  # requests waiting for a place
QUEUE_TIMEOUT_S = 2.0  # longest wait for a place
TALKER_GRACE_S = 20.0  # SIGTERM: time a talker gives its in-flight streams (the drain test)
SETTLE_S = 5.0  # time every in-flight count gets to return to 0


@dataclass
class Reliable:
    """The running stack plus what the tests read from it."""

    stack: Stack
    metrics_url: str  # the router's Prometheus endpoint

    @property
    def replicas(self) -> dict[str, tuple[str, ...]]:
        """stage -> addresses of its replicas whose process has not exited. One the test killed or
        drained on purpose is not a replica that hangs; one stopped (SIGSTOP) is still here, and
        counts as busy when its load cannot be read."""
        running = {f"{self.stack.options.host}:{p.port}" for p in self.stack.processes.values()
                   if p.popen.poll() is None}
        return {stage: tuple(a for a in self.stack.addresses(stage) if a in running) for stage in STAGES}

    @property
    def target(self) -> str:
        return self.stack.target

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.stack.port(name)}"

    def kill(self, name: str, sig: int = signal.SIGKILL) -> float:
        """Signal process `name`; returns the perf_counter time it was sent."""
        sent = time.perf_counter()
        self.stack.kill(name, sig)
        return sent

    def restart(self, name: str) -> None:
        """Start a stopped process again on its address; returns once it reports SERVING."""
        self.stack.restart(name)

    def popen(self, name: str):
        return self.stack.processes[name].popen

    def router_sees(self, name: str) -> bool:
        """Whether the router takes process `name` as SERVING and not draining."""
        process = self.stack.processes[name]
        return read_router_gauges(self.metrics_url).healthy.get((process.stage, self.address(name)), False)

    def wait_router_sees(self, name: str, healthy: bool, timeout_s: float) -> float:
        """Seconds until the router's view of `name` is `healthy`; fails the test past the timeout."""
        start = time.monotonic()
        while self.router_sees(name) != healthy:
            assert time.monotonic() - start < timeout_s, f"router still sees {name} as {not healthy} after {timeout_s} s"
            time.sleep(0.05)
        return time.monotonic() - start

    def revive(self) -> None:
        """Restart every process that is not running; wait until the router uses them all."""
        for name, process in self.stack.processes.items():
            if process.popen.poll() is not None:
                self.stack.restart(name)
        for name, process in self.stack.processes.items():
            if process.stage in STAGES:  # the router's replicas (not the router, not the sessions service)
                # NOTE: can take seconds after a long outage: the router's channel to a dead replica
                # backs off its reconnects (gRPC's default backoff grows to 120 s).
                self.wait_router_sees(name, True, timeout_s=60.0)


def assert_recovered(stack: Reliable, omni) -> None:
    """How every test ends: each stage replica and the router back to nothing in flight, running
    or queued within a few seconds, and a normal request then succeeds."""
    settled = wait_settled(stack.replicas, stack.metrics_url, SETTLE_S)
    assert settled.idle, f"not idle {SETTLE_S} s after the test: {settled.busy()}, router {settled.router}"
    call = Call(omni.Generate, build_request("still there?", max_new_tokens=4, talker_max_new_tokens=8), 60).run()
    assert call.code.name == "OK", (call.code, call.details)
    assert call.texts == 4 and call.audios >= 1 and call.final is not None
    settled = wait_settled(stack.replicas, stack.metrics_url, SETTLE_S)
    assert settled.idle, settled.busy()
