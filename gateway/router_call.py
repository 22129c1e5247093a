"""The gateway's side of the router: the channel its calls go on (`Gateway`, one a process), one
`Omni/Generate` call started, watched and read (`Call`), and the metrics both keep. A call's
failure becomes an OpenAI error through gateway/errors.py; a caller that goes away cancels the
call, which frees the request in every stage.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
from fastapi import Request
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.config import GatewayConfig
from gateway.errors import APIError, from_rpc
from omni.v1 import omni_pb2, omni_pb2_grpc
from services.serving import tracing
from services.serving.channels import RotatingChannels
from services.serving.gc_heap import GCCollector
from services.serving.grpc_server import channel_options
from services.serving.streams import read

OMNI_SERVICE = "omni.v1.Omni"
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
        self._stub: tuple[grpc.aio.Channel, omni_pb2_grpc.OmniStub] | None = None
        self._opened = 0.0  # monotonic time the current channel was opened
        self.created = int(time.time())

    async def open(self) -> None:
        options = channel_options(self.config.max_message_bytes) + [ROUND_ROBIN]
        self.channels = RotatingChannels(self.config.tls, options)
        self.channel()

    async def close(self) -> None:
        if self.channels is not None:
            await self.channels.close()

    def channel(self) -> grpc.aio.Channel:
        """The channel to the router for a new call. A new one when the TLS files rotated (its
        handshakes use the new certificate; RotatingChannels) or every `router_refresh_s` (a new DNS
        resolution: router pods added since are called too); the old one closes after its calls."""
        now = time.monotonic()
        if self._stub is not None and now - self._opened > self.config.router_refresh_s:
            self.channels._retire(self._stub[0])
            self.channels._channels.pop(self.config.router, None)
        channel = self.channels.get(self.config.router)
        if self._stub is None or self._stub[0] is not channel:
            self._stub, self._opened = (channel, omni_pb2_grpc.OmniStub(channel)), now
        return channel

    def stub(self) -> omni_pb2_grpc.OmniStub:
        self.channel()
        return self._stub[1]

    async def ready(self) -> bool:
        try:
            response = await health_pb2_grpc.HealthStub(self.channel()).Check(
                health_pb2.HealthCheckRequest(service=OMNI_SERVICE), timeout=2.0)
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING


class ClientGone(Exception):
    """The HTTP client went away before its response: nothing to send (the app answers 499)."""


class Call:
    """One router Generate call: started, its first response awaited (so that a failure before any
    output is an HTTP status, not a broken stream), then iterated; `cancel()` frees the pipeline."""

    def __init__(self, gateway: Gateway, request: omni_pb2.GenerateRequest, http: Request, endpoint: str):
        self.gateway = gateway
        self.endpoint = endpoint
        self.received = time.perf_counter()
        auth = http.headers.get("authorization")
        metadata = (("authorization", auth),) if auth else None
        self.call = tracing.call("/omni.v1.Omni/Generate", gateway.stub().Generate, request,
                                 timeout=gateway.config.timeout_s, metadata=metadata)
        self.first: omni_pb2.GenerateResponse | None = None
        self.final: omni_pb2.Final | None = None
        self._seen_audio = False
        self._counted = False

    async def start(self, http: Request) -> None:
        """Waits for the first response (the router's queue included), cancelling the call as soon
        as the HTTP client goes away meanwhile."""
        self.gateway.metrics.in_flight.inc()
        try:
            async with self._watching(http):
                self.first = await read(self.call)  # never cancelled mid-read (services/serving/streams.py)
        except BaseException:
            self.done()
            raise
        if self.first is grpc.aio.EOF:
            self.done()
            raise APIError(502, "the router ended the stream without a response", "server_error", None, "bad_gateway")
        self.gateway.metrics.ttfb.labels(self.endpoint).observe(time.perf_counter() - self.received)

    async def responses(self):
        """Every response, the first included; raises grpc.RpcError if the call fails later."""
        response = self.first
        while response is not grpc.aio.EOF:
            kind = response.WhichOneof("event")
            if kind == "audio" and not self._seen_audio:
                self._seen_audio = True
                self.gateway.metrics.ttfp.labels(self.endpoint).observe(time.perf_counter() - self.received)
            elif kind == "final":
                self.final = response.final
            yield response
            response = await read(self.call)

    async def collected(self, http: Request):
        """The responses of a reply sent whole, the disconnect watched for meanwhile (such a reply has
        no body to fail on)."""
        async with self._watching(http):
            async for response in self.responses():
                yield response

    @asynccontextmanager
    async def _watching(self, http: Request):
        """Cancels the call as soon as the HTTP client goes away, and then raises ClientGone instead
        of the call's CANCELLED; a failed call raises its APIError."""
        watcher = asyncio.create_task(_watch_disconnect(http, self))
        try:
            yield
        except (grpc.RpcError, asyncio.CancelledError) as err:
            if _left(watcher):
                raise ClientGone from None
            if isinstance(err, asyncio.CancelledError):
                raise
            raise self.error(err) from None
        finally:
            watcher.cancel()

    def error(self, err: grpc.RpcError) -> APIError:
        return from_rpc(err, speech=self.endpoint == "speech")

    @property
    def usage(self) -> omni_pb2.Usage:
        return self.final.usage if self.final is not None else omni_pb2.Usage()

    def cancel(self) -> None:
        self.call.cancel()  # a no-op once the call ended
        self.done()

    def done(self) -> None:
        if not self._counted:
            self._counted = True
            self.gateway.metrics.in_flight.dec()


async def _watch_disconnect(http: Request, call: Call) -> bool:
    """True (and the call cancelled) once the client disconnects; runs until cancelled."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            call.cancel()
            return True


def _left(watcher: asyncio.Task) -> bool:
    """The client went away (the watcher saw it and cancelled the call), and this task itself is not
    being cancelled: a read of a cancelled grpc.aio call raises CancelledError (or CANCELLED), which
    is then only how the call ended, not an order to stop."""
    task = asyncio.current_task()
    return (watcher.done() and not watcher.cancelled() and watcher.result()
            and not (task is not None and task.cancelling()))
