"""Replicas of one stage (or service): discovery (static list or DNS), health, load, and the pick.
The router keeps one set per stage; the gateway one of the sessions service's replicas, which
report the sessions they hold on the same `GetLoad` (`ReplicaSet.stub` picks the service).

Each stage's replicas come from a static list (`host:port,host:port`) or a DNS name
(`dns:///omni-talker:50062`: every A record, re-resolved periodically, the way a Kubernetes
headless service is read). A background task polls every replica's grpc.health.v1 status and
its own load report (`GetLoad`). `pick()` returns the least-loaded healthy replica that is not
draining, scoring each by its reported queue and running batch plus what this router has in
flight on it (which moves between polls). A call that fails with UNAVAILABLE marks its replica
unhealthy at once, so new requests avoid a dead pod before the next poll; a restarted replica
comes back when its health says SERVING again.

TLS names: replicas are dialled at their pod IPs, so the name checked in a replica's certificate
is the DNS name it was found under (`omni-talker` for `dns:///omni-talker:50062`; the
certificate of every pod behind a headless Service carries that name), unless `--tls-server-name`
sets one for every stage. Static `host:port` replicas are checked against their host.

A poll that fails is weighed by how it failed (`PollVerdict`): a refused or reset connection
(UNAVAILABLE) or a NOT_SERVING answer takes the replica out at once; a poll that only ran past
its deadline (a loaded machine, a paused process) makes it *suspect*: it keeps its requests and
still takes new ones until `down_after_misses` polls in a row miss, so a replica that is merely
slow is never dropped. The metrics show each replica's state (`omni_router_replica_state`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni.v1 import common_pb2
from services.base.errors import UserError
from services.serving.channels import RotatingChannels
from services.serving.prefix_routing import DEFAULT_PREFIX_WEIGHT, PrefixView, Routing
from services.serving.security import TLSConfig
from services.serving.stage_stubs import stage_stub

log = logging.getLogger("replicas")

UP, SUSPECT, DOWN = "up", "suspect", "down"
STATES = (UP, SUSPECT, DOWN)
DOWN_AFTER_MISSES = 3  # polls in a row that run past their deadline before a replica counts as down


def poll_verdict(code: grpc.StatusCode | None, serving: bool) -> str:
    """What one poll says: UP (answered SERVING), DOWN (answered NOT_SERVING, or the connection
    was refused or reset), or SUSPECT (no answer within the deadline: maybe just slow)."""
    if code is None:
        return UP if serving else DOWN
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return SUSPECT
    return DOWN


@dataclass
class Replica:
    address: str  # host:port
    healthy: bool = False
    draining: bool = False
    load: common_pb2.LoadReport | None = None
    in_flight: int = 0  # this router's requests on it now
    last_ok: float = 0.0  # monotonic time of the last successful poll
    misses: int = 0  # polls in a row that ran past their deadline
    missed_polls: int = 0  # polls that ran past their deadline since the start (counted here, never sampled)
    downs: int = 0  # times it was taken out (a poll or a failed call) since the start
    prefix: PrefixView = field(default_factory=PrefixView)  # a thinker's prefix cache, as it reports it

    @property
    def state(self) -> str:
        if not self.healthy:
            return DOWN
        return SUSPECT if self.misses else UP

    @property
    def reported(self) -> int:
        """Queued plus running requests at the last poll (every router's, ours among them)."""
        return (self.load.queue_depth + self.load.running) if self.load is not None else 0

    @property
    def score(self) -> float:
        # Our live count, or the replica's report where other routers add to it. Not their sum: the
        # report already holds our requests, and it lags by up to a poll, so a sum counts a burst
        # that just ended twice and sends the next burst all to the other replicas.
        return max(self.in_flight, self.reported)

    @property
    def saturated(self) -> bool:
        """Requests wait for a KV slot here: no prefix credit sends it more."""
        return self.load is not None and self.load.queue_depth > 0


@dataclass(frozen=True)
class ReplicaSource:
    """Where a stage's replicas come from: fixed addresses, or a DNS name to resolve."""

    static: tuple[str, ...] = ()
    dns_host: str | None = None
    dns_port: int | None = None

    @classmethod
    def parse(cls, spec: str, flag: str) -> ReplicaSource:
        spec = spec.strip()
        if spec.startswith("dns:"):
            target = spec.removeprefix("dns:").lstrip("/")
            host, _, port = target.rpartition(":")
            if not host or not port.isdigit():
                raise UserError(f"{flag}: expected dns:///host:port, got {spec!r}")
            return cls(dns_host=host, dns_port=int(port))
        targets = tuple(t.strip() for t in spec.split(",") if t.strip())
        if not targets or any(":" not in t for t in targets):
            raise UserError(f"{flag}: expected host:port[,host:port] or dns:///host:port, got {spec!r}")
        return cls(static=targets)

    def resolve(self) -> list[str]:
        if self.dns_host is None:
            return list(self.static)
        infos = socket.getaddrinfo(self.dns_host, self.dns_port, type=socket.SOCK_STREAM)
        addresses = sorted({info[4][0] for info in infos})
        return [f"[{a}]:{self.dns_port}" if ":" in a else f"{a}:{self.dns_port}" for a in addresses]


@dataclass
class ReplicaSet:
    stage: str
    source: ReplicaSource
    channel_options: list = field(default_factory=list)
    poll_interval_s: float = 1.0
    dns_refresh_s: float = 5.0
    tls: TLSConfig = TLSConfig()
    down_after_misses: int = DOWN_AFTER_MISSES
    routing: Routing = Routing.LEAST_LOADED  # prefix: the thinkers' (services/serving/prefix_routing.py)
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT
    stub: Callable | None = None  # channel -> the stub whose GetLoad is polled; None: the stage's (stage_stub)
    metadata: tuple[tuple[str, str], ...] = ()  # sent with each GetLoad (a bearer token where the replicas ask one)
    replicas: dict[str, Replica] = field(default_factory=dict)  # address -> replica
    _channels: RotatingChannels | None = None  # address -> channel, new ones after a TLS rotation
    _task: asyncio.Task | None = None
    _last_resolve: float = -1e9

    def __post_init__(self) -> None:
        self._channels = RotatingChannels(self.tls, self.channel_options)

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll_forever(), name=f"replicas-{self.stage}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._channels.close()

    def ranked(self, exclude: set[str] = frozenset(), prefix_keys: list[bytes] = ()) -> list[Replica]:
        """Healthy replicas that are not draining, cheapest first (ties in random order): least
        loaded, less, with prefix routing, the credit of the request's prefix each holds
        (services/serving/prefix_routing.py; `prefix_keys`: the request's message keys)."""
        candidates = [r for r in self.replicas.values() if r.healthy and not r.draining and r.address not in exclude]
        random.shuffle(candidates)
        if self.routing is Routing.RANDOM:
            return candidates
        return sorted(candidates, key=lambda r: r.score - self.credit(r, prefix_keys))

    def credit(self, replica: Replica, prefix_keys: list[bytes]) -> float:
        """Requests of load the prefix `replica` holds of a request is worth (0 when saturated)."""
        if self.routing is not Routing.PREFIX or not prefix_keys or replica.saturated:
            return 0.0
        return self.prefix_weight * replica.prefix.matched(prefix_keys) / 1000

    def pick(self, exclude: set[str] = frozenset(), prefix_keys: list[bytes] = ()) -> Replica | None:
        ranked = self.ranked(exclude, prefix_keys)
        return ranked[0] if ranked else None

    def mark_failed(self, address: str) -> None:
        replica = self.replicas.get(address)
        if replica is not None and replica.healthy:
            log.warning("%s replica %s failed a call; unhealthy until it answers SERVING again", self.stage, address)
            replica.healthy = False
            replica.downs += 1

    async def refresh(self) -> None:
        """One round: re-resolve if due, then poll health and load of every replica."""
        now = time.monotonic()
        if now - self._last_resolve >= self.dns_refresh_s or not self.replicas:
            self._last_resolve = now
            try:
                addresses = await asyncio.to_thread(self.source.resolve)
            except OSError as exc:
                log.warning("%s: cannot resolve %s: %s", self.stage, self.source.dns_host, exc)
                addresses = list(self.replicas)
            for address in addresses:
                self.replicas.setdefault(address, Replica(address))
            for gone in set(self.replicas) - set(addresses):
                self.replicas.pop(gone)
                await self._channels.drop(gone)
        await asyncio.gather(*(self._poll(r) for r in list(self.replicas.values())))

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # keep polling whatever happens
                log.exception("%s: replica poll failed", self.stage)
            await asyncio.sleep(self.poll_interval_s)

    def channel(self, address: str) -> grpc.aio.Channel:
        """The channel to one replica; a new one once the TLS files have rotated."""
        return self._channels.get(address, server_name=self.source.dns_host)

    async def _poll(self, replica: Replica) -> None:
        channel = self.channel(replica.address)
        code, load, serving = None, None, False
        try:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            serving = health.status == health_pb2.HealthCheckResponse.SERVING
            stub = self.stub(channel) if self.stub is not None else stage_stub(self.stage, channel)
            load = (await stub.GetLoad(replica.prefix.request(), timeout=1.0, metadata=self.metadata or None)
                    if serving else None)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
        verdict = poll_verdict(code, serving)
        if verdict == SUSPECT:
            replica.misses += 1
            replica.missed_polls += 1
            if replica.misses < self.down_after_misses or not replica.healthy:
                if replica.healthy:
                    log.info("%s replica %s is suspect: %d poll(s) in a row missed their deadline", self.stage,
                             replica.address, replica.misses)
                return  # keep what it last reported
            verdict = DOWN
        if (verdict == UP) != replica.healthy:
            log.info("%s replica %s is %s", self.stage, replica.address,
                     "SERVING" if verdict == UP else f"down ({code.name if code else 'not serving'})")
        replica.misses = 0
        if replica.healthy and verdict != UP:
            replica.downs += 1
        replica.healthy = verdict == UP
        replica.load = load
        if load is not None and load.HasField("prefix"):
            replica.prefix.apply(load.prefix)
        replica.draining = bool(load.draining) if load is not None else not replica.healthy
        if replica.healthy:
            replica.last_ok = time.monotonic()


def publish_state(metrics, stage: str, replica: Replica) -> None:
    """omni_router_replica_state{state=...}: 1 for the replica's state, 0 for the others."""
    for state in STATES:
        metrics.replica_state.labels(stage, replica.address, state).set(int(replica.state == state))
    metrics.replica_reported_load.labels(stage, replica.address).set(replica.reported)
    metrics.replica_missed_polls.labels(stage, replica.address).set(replica.missed_polls)
    metrics.replica_downs.labels(stage, replica.address).set(replica.downs)
