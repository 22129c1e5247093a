"""Extra routers and sessions services as real processes over a running stack's stages, for the
tests that need their own bounds or kill a router (routers and sessions services hold no model:
each starts in about a second)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.tools.launcher import Stack, free_port


@dataclass
class Proc:
    module: str  # router.server or sessions.server
    args: list[str]
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    popen: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, service: str = "") -> Proc:
        """Start it on its port and wait until `service` reports SERVING (the router: omni.v1.Omni,
        every stage has a healthy replica)."""
        self.popen = subprocess.Popen([sys.executable, "-m", self.module, "--host", "127.0.0.1", "--port", str(self.port),
                                       "--metrics-port", str(self.metrics_port), *self.args],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while health(self.target, service) != "SERVING":
            assert self.popen.poll() is None, f"{self.module} exited with {self.popen.returncode}"
            assert time.monotonic() < deadline, f"{self.module} never reported SERVING"
            time.sleep(0.1)
        return self

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def health(target: str, service: str = "") -> str:
    with grpc.insecure_channel(target) as channel:
        try:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1).status)
        except grpc.RpcError:
            return "UNREACHABLE"


def router(stack: Stack, *args: str) -> Proc:
    """A router over the stack's stage replicas, started and ready."""
    routes = []
    for stage in ("thinker", "talker", "code2wav"):
        routes += [f"--{stage}", ",".join(stack.addresses(stage))]
    return Proc("router.server", ["--poll-interval-s", "0.5", *routes, *args]).start("omni.v1.Omni")


def sessions(routers: str, *args: str) -> Proc:
    """A sessions service whose turns go to `routers` (host:port[,host:port]), started and serving."""
    return Proc("sessions.server", ["--router", routers, *args]).start()


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, as a Prometheus scrape reads them."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
