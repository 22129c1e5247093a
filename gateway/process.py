"""What one gateway process holds: its settings, its metrics, its channel to the router (`Gateway`),
which every call (gateway/router_call.py) goes on, and the sessions service's replicas, which
/v1/realtime's sessions go to (gateway/realtime.py): discovered, polled and picked as the router
picks a stage's replicas (services/serving/replicas.py: the least loaded healthy one that is not
draining, by the sessions each reports on GetLoad and this gateway's own count)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.config import GatewayConfig
from omni.v1 import omni_pb2_grpc
from services.serving.channels import RotatingChannels
from services.serving.gc_heap import GCCollector
from services.serving.grpc_server import channel_options
from services.serving.replicas import Replica, ReplicaSet, ReplicaSource

OMNI_SERVICE = "omni.v1.Omni"
SESSIONS = "sessions"  # the sessions service's replica set (its name in logs)
# Every router call goes round robin over the addresses its target resolves to: one for a Service's
# ClusterIP, every ready router pod for a headless Service (dns:///omni-router-headless:50051).
ROUND_ROBIN = ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]}))


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        r.register(GCCollector())
        self.requests = Counter("omni_gateway_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("omni_gateway_in_flight", "router calls in progress", registry=r)
        self.ttfb = Histogram("omni_gateway_first_event_seconds",
                              "request received to first router event (text or audio)", ["endpoint"], registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.ttfp = Histogram("omni_gateway_ttfp_seconds", "request received to first audio chunk", ["endpoint"],
                              registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.metrics = Metrics()
        self.channels: RotatingChannels | None = None
        self.sessions: ReplicaSet | None = None  # the sessions service's replicas, polled once open
        self._stub: tuple[grpc.aio.Channel, omni_pb2_grpc.OmniStub] | None = None
        self._opened = 0.0  # monotonic time the current channel was opened
        self.created = int(time.time())

    async def open(self) -> None:
        options = channel_options(self.config.max_message_bytes) + [ROUND_ROBIN]
        self.channels = RotatingChannels(self.config.tls, options)
        self.channel()
        # The router's name (--tls-server-name) is not the sessions pods': each is checked under the
        # name it was found by (dns:///omni-sessions-headless:50052 -> omni-sessions-headless).
        self.sessions = ReplicaSet(SESSIONS, ReplicaSource.parse(self.config.sessions, "--sessions"),
                                   channel_options(self.config.max_message_bytes),
                                   tls=replace(self.config.tls, server_name=None), stub=omni_pb2_grpc.SessionsStub,
                                   metadata=self.session_metadata())
        await self.sessions.refresh()
        self.sessions.start()

    def own_auth(self) -> str | None:
        """The gateway's own bearer token (the first of its tokens): what it presents to the sessions
        service (its load polls, and a session opened with a client secret), None without tokens."""
        tokens = self.config.auth_tokens
        return f"Bearer {tokens[0].decode()}" if tokens else None

    def session_metadata(self) -> tuple[tuple[str, str], ...]:
        auth = self.own_auth()
        return (("authorization", auth),) if auth else ()

    async def close(self) -> None:
        if self.sessions is not None:
            await self.sessions.close()
        if self.channels is not None:
            await self.channels.close()

    def channel(self) -> grpc.aio.Channel:
        """The channel to the router for a new call. A new one when the TLS files rotated (its
        handshakes use the new certificate; RotatingChannels) or every `router_refresh_s` (a new DNS
        resolution: router pods added since are called too); the old one closes after its calls."""
        now = time.monotonic()
        if self._stub is not None and now - self._opened > self.config.router_refresh_s:
            self.channels.renew(self.config.router)
        channel = self.channels.get(self.config.router)
        if self._stub is None or self._stub[0] is not channel:
            self._stub, self._opened = (channel, omni_pb2_grpc.OmniStub(channel)), now
        return channel

    def stub(self) -> omni_pb2_grpc.OmniStub:
        self.channel()
        return self._stub[1]

    def pick_sessions(self) -> tuple[Replica, omni_pb2_grpc.SessionsStub] | None:
        """The sessions replica a new session goes to and its stub (None: no replica is ready)."""
        replica = self.sessions.pick()
        if replica is None:
            return None
        return replica, omni_pb2_grpc.SessionsStub(self.sessions.channel(replica.address))

    async def ready(self) -> bool:
        try:
            response = await health_pb2_grpc.HealthStub(self.channel()).Check(
                health_pb2.HealthCheckRequest(service=OMNI_SERVICE), timeout=2.0)
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING
