"""What every gRPC service shares: channel options, health, reflection, SIGTERM.

Each service builds its server with `build_server`, registers its servicer, then calls
`serve_until_signal`, which marks it SERVING, and on SIGTERM / SIGINT turns NOT_SERVING,
lets in-flight streams finish within the grace period, and stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.serving.decode_guard import DecodeGuard
from services.serving.gc_heap import freeze_startup_heap
from services.serving.open_streams import OpenStreams
from services.serving.placement import Placement
from services.serving.security import TLSConfig
from services.serving.tracing import log_formatter, server_interceptors
from services.serving.tracing import setup as setup_tracing

log = logging.getLogger(__name__)

# Hidden states of a long multimodal prompt at the real model's width (2048 x fp32) run to tens
# of MB; set the limit explicitly on both ends of every channel instead of relying on 4 MB.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# SIGTERM: how long a server keeps taking calls while it reports NOT_SERVING (--drain-delay-s).
DEFAULT_DRAIN_DELAY_S = 2.0


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A restarted replica should be seen within a poll or two, not after gRPC's default
        # backoff (which grows to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return channel_options(max_message_bytes) + [
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.so_reuseport", 0),
    ]


@dataclass
class ServerHandle:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    draining: bool = False  # SIGTERM received: NOT_SERVING, finishing in-flight streams
    health_server: grpc.aio.Server | None = None  # plaintext, health only (--health-port)
    health_port: int | None = None
    streams: OpenStreams | None = None  # the open streams of `service_names` (LoadReport.in_flight)

    async def set_serving(self, serving: bool, services: tuple[str, ...] | None = None) -> None:
        """Health of `services` (default: the overall status "" and every service of this server)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in services if services is not None else ("",) + self.service_names:
            await self.health.set(name, status)


def build_server(host: str, port: int, service_names: tuple[str, ...],
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: TLSConfig = TLSConfig(),
                 interceptors: tuple = (), health_port: int = 0, options: tuple = ()) -> ServerHandle:
    """A grpc.aio server with health (NOT_SERVING until the model is loaded) and reflection;
    TLS (mutual with a CA) when `tls` has a certificate. `health_port` adds a second, plaintext
    server with only grpc.health.v1 (the same statuses): Kubernetes' native gRPC probes cannot
    speak TLS."""
    # DecodeGuard first: a body that is not the method's message ends INVALID_ARGUMENT, not UNKNOWN.
    streams = OpenStreams(service_names)
    server = grpc.aio.server(options=server_options(max_message_bytes) + list(options),
                             interceptors=(DecodeGuard(), streams) + server_interceptors() + tuple(interceptors))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        service_names + (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    credentials = tls.server_credentials()
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    handle = ServerHandle(server=server, port=bound, health=health_servicer, service_names=service_names, streams=streams)
    if health_port:
        handle.health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, handle.health_server)
        handle.health_port = handle.health_server.add_insecure_port(f"{host}:{health_port}")
        if handle.health_port == 0:
            raise OSError(f"cannot bind {host}:{health_port}")
    return handle


async def serve_until_signal(handle: ServerHandle, grace_s: float, on_started=None, on_stop=None,
                             initially_serving: bool = True, drain_delay_s: float = DEFAULT_DRAIN_DELAY_S,
                             light_load_cpus: frozenset[int] | None = None,
                             started_services: tuple[str, ...] | None = None) -> None:
    """Start the server, set `started_services` (default: the overall status and every service)
    to `initially_serving`, serve until SIGTERM / SIGINT, then drain and stop. A service whose
    readiness its caller keeps (the router's omni.v1.Omni) is left out of `started_services`, so
    it never reads SERVING before its caller says so."""
    if light_load_cpus is not None and handle.streams is not None:
        placement = Placement(light_load_cpus)
        placement.update(handle.streams.open)
        handle.streams.on_change = placement.update
    log.info("froze %d start-up objects out of garbage collection", freeze_startup_heap())
    await handle.server.start()
    if handle.health_server is not None:
        await handle.health_server.start()
    await handle.set_serving(initially_serving, started_services)
    if on_started is not None:
        on_started()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving on port %d", handle.port)
    await stop.wait()
    log.info("draining: NOT_SERVING, finishing in-flight streams (grace %.0f s)", grace_s)
    handle.draining = True
    await handle.set_serving(False)
    # NOTE: keep taking calls while routers and probes see NOT_SERVING (they poll every 0.5-1 s);
    # server.stop() refuses every new call at once, health checks included.
    await asyncio.sleep(min(drain_delay_s, grace_s))
    await handle.server.stop(grace_s)
    if handle.health_server is not None:
        await handle.health_server.stop(0)
    if on_stop is not None:
        on_stop()


def time_remaining(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds left of the caller's deadline, to hand on to the next stage (None = no deadline)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e8 else max(remaining, 0.001)


class _PeerGone(logging.Filter):
    """grpc aio logs ERROR with a traceback ("ExecuteBatchError raised in core by servicer
    method [...]") when a handler's send races the caller's cancellation or deadline: the call
    has ended, the send has nowhere to go. That is the normal way a cancelled stream ends, so it
    becomes one debug line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("ExecuteBatchError raised in core"):
            log.debug("a send raced the end of the call (cancelled by its caller): %s", message.splitlines()[0])
            return False
        return True


def setup_logging(name: str, log_format: str = "text") -> None:
    """INFO to stderr, as text lines or (`log_format` json) one JSON object a line with the trace
    and request ids (services/serving/tracing.py)."""
    handler = logging.StreamHandler()
    handler.setFormatter(log_formatter(name, log_format))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("grpc._cython.cygrpc").addFilter(_PeerGone())


def write_port_file(path: str | None, port: int) -> None:
    """Write the bound port atomically (the launcher and tests read it for port 0)."""
    if not path:
        return
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


def run_process(name: str, serve, config, port_file: str | None) -> None:
    """A service process until SIGTERM: logging and tracing set up under `name`, then the coroutine
    `serve(config, port_file)` run (`config.serving` is its ServingConfig)."""
    setup_logging(name, config.serving.tracing.log_format)
    setup_tracing(name, config.serving.tracing, config.serving.port)
    asyncio.run(serve(config, port_file))
