"""The leak check: every stage replica's load (`GetLoad`), the router's gauges, and the wait until
both hold nothing."""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass, field

import grpc

from omni.v1 import common_pb2
from services.base.stages import Stage
from services.serving.stage_stubs import stage_stub

STAGES = tuple(Stage)



@dataclass(frozen=True)
class StageLoad:
    stage: str
    address: str
    in_flight: int = 0  # streams open on the replica
    running: int = 0
    queue_depth: int = 0
    reachable: bool = True
    in_flight_peak: int = 0  # the most streams open at once since the start or the last reset (the stage's count)
    streams_total: int = 0  # streams opened since the process started (the stage's count)

    @property
    def idle(self) -> bool:
        """Whether the replica reported holding nothing. A replica whose load cannot be read (dead,
        stopped, hung) is never idle: nothing proves it let go of its work. Callers that killed a
        replica on purpose leave its address out of what they check."""
        return self.reachable and not (self.in_flight or self.running or self.queue_depth)


def read_load(stage: str, address: str, timeout: float = 1.0, reset_peak: bool = False) -> StageLoad:
    """The replica's GetLoad; `reset_peak` starts a new high-water mark after this report."""
    with grpc.insecure_channel(address) as channel:
        try:
            report = stage_stub(stage, channel).GetLoad(common_pb2.LoadRequest(reset_peak=reset_peak), timeout=timeout)
        except grpc.RpcError:
            return StageLoad(stage, address, reachable=False)
    return StageLoad(stage, address, report.in_flight, report.running, report.queue_depth,
                     in_flight_peak=report.in_flight_peak, streams_total=report.streams_total)


def read_loads(replicas: dict[str, tuple[str, ...]]) -> list[StageLoad]:
    """Every replica's load; replicas: stage -> addresses. An unreachable one comes back with
    reachable=False, which counts as busy (StageLoad.idle)."""
    return [read_load(stage, address) for stage, addresses in replicas.items() for address in addresses]


@dataclass(frozen=True)
class RouterGauges:
    in_flight: int  # requests admitted and streaming
    queue_depth: int  # requests waiting for admission
    healthy: dict  # (stage, address) -> bool: SERVING and not draining, as the router sees it
    outcomes: dict  # outcome label -> requests counted
    reported: dict = field(default_factory=dict)  # (stage, address) -> queued + running at the router's last poll
    in_flight_peak: int = 0  # the most requests admitted at once since the router started (its own count)

    @property
    def replicas(self) -> dict[str, tuple[str, ...]]:
        """stage -> the addresses the router knows."""
        return {stage: tuple(a for s, a in sorted(self.healthy) if s == stage) for stage in STAGES}


def read_router_gauges(url: str, timeout: float = 2.0) -> RouterGauges:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    in_flight = queue_depth = peak = 0
    healthy, outcomes, reported = {}, {}, {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "omni_router_in_flight":
                in_flight = int(sample.value)
            elif sample.name == "omni_router_in_flight_peak":
                peak = int(sample.value)
            elif sample.name == "omni_router_queue_depth":
                queue_depth = int(sample.value)
            elif sample.name == "omni_router_replica_healthy":
                healthy[(sample.labels["stage"], sample.labels["replica"])] = sample.value == 1.0
            elif sample.name == "omni_router_requests_total":
                outcomes[sample.labels["outcome"]] = int(sample.value)
            elif sample.name == "omni_router_replica_reported_load":
                reported[(sample.labels["stage"], sample.labels["replica"])] = int(sample.value)
    return RouterGauges(in_flight, queue_depth, healthy, outcomes, reported, peak)


@dataclass(frozen=True)
class Settled:
    loads: tuple[StageLoad, ...]
    router: RouterGauges | None
    seconds: float  # how long settling took (or the whole wait, if it never did)

    @property
    def leaked(self) -> int:
        """Streams still open on the stages plus requests the router still counts as admitted."""
        router = self.router.in_flight + self.router.queue_depth if self.router is not None else 0
        return sum(load.in_flight for load in self.loads) + router

    @property
    def idle(self) -> bool:
        # The router's view counts too: a load it polled before the stages went idle would steer
        # the next requests away from those replicas.
        router_idle = self.router is None or (self.router.in_flight == 0 and self.router.queue_depth == 0
                                              and not any(self.router.reported.values()))
        return router_idle and all(load.idle for load in self.loads)

    def busy(self) -> dict[str, tuple[int, int, int] | str]:
        """'stage address' -> (in_flight, running, queue_depth) of every replica not idle, or
        'unreachable' for one whose load could not be read."""
        return {f"{load.stage} {load.address}": (load.in_flight, load.running, load.queue_depth) if load.reachable
                else "unreachable" for load in self.loads if not load.idle}


def wait_settled(replicas: dict[str, tuple[str, ...]], metrics_url: str | None = None,
                 timeout_s: float = 10.0) -> Settled:
    """Poll until every stage replica (and the router, given its metrics) holds nothing."""
    start = time.monotonic()
    while True:
        router = read_router_gauges(metrics_url) if metrics_url else None
        settled = Settled(tuple(read_loads(replicas)), router, time.monotonic() - start)
        if settled.idle or settled.seconds >= timeout_s:
            return settled
        time.sleep(0.1)
