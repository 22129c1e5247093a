"""Serving settings of a process: where it listens, how it ends, TLS, metrics, stream timeouts.
One frozen dataclass, filled from flags once at start-up; nothing here knows about models.

Every flag also reads an environment variable (OMNI_<FLAG>), so the Kubernetes ConfigMap can set
them; flags win over the environment.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.base.env import env_default
from services.serving.grpc_server import DEFAULT_DRAIN_DELAY_S, DEFAULT_MAX_MESSAGE_BYTES
from services.serving.open_streams import LIGHT_LOAD_STREAMS
from services.serving.placement import parse_cpus
from services.serving.security import TLSConfig, add_tls_flags, tls_from_args
from services.serving.tracing import TracingConfig, add_tracing_flags, tracing_from_args


@dataclass(frozen=True)
class ServingConfig:
    host: str = "0.0.0.0"
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 30.0  # SIGTERM: time to finish in-flight streams
    drain_delay_s: float = DEFAULT_DRAIN_DELAY_S  # SIGTERM: time NOT_SERVING is shown while still taking calls
    metrics_port: int = 0  # Prometheus /metrics over HTTP; 0 = off
    stream_idle_timeout_s: float = 120.0  # a stream with no progress this long is ended (dead peer)
    tls: TLSConfig = TLSConfig()  # plaintext unless certificates are given
    health_port: int = 0  # a plaintext grpc.health.v1-only port (for probes when TLS is on); 0 = none
    light_load_cpus: frozenset[int] | None = None  # services/serving/placement.py; None = anywhere
    tracing: TracingConfig = TracingConfig()  # OTLP traces and the log format (services/serving/tracing.py)

    def stall_timeout_s(self, stages_below: int) -> float:
        """How long a stage waits on a stream whose far end itself waits on `stages_below` further
        stages: half an idle timeout more per stage below, so when a stage hangs, the stage that
        calls it times out first and names it, and that status reaches the caller before any
        stage further up gives up on its own (the thinker's wait on the talker is 1.5x the idle
        timeout, the talker's on code2wav 1x, each handler's wait on anything at all one step more)."""
        return self.stream_idle_timeout_s * (1 + 0.5 * stages_below)


def add_serving_flags(parser: argparse.ArgumentParser, default_port: int,
                      idle_timeout_help: str = "end a stream that made no progress for this long (default 120)",
                      max_message_mb: int = DEFAULT_MAX_MESSAGE_BYTES >> 20) -> None:
    """The flags every process serving gRPC has (stages and router): one definition, one ServingConfig."""
    parser.add_argument("--host", default=env_default("host", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=env_default("port", default_port), help="0 = any free port")
    parser.add_argument("--max-message-mb", type=int, default=env_default("max_message_mb", max_message_mb),
                        help=f"largest request or response message, both directions (default {max_message_mb})")
    parser.add_argument("--grace-s", type=float, default=env_default("grace_s", 30.0),
                        help="on SIGTERM, seconds to let in-flight streams finish")
    parser.add_argument("--drain-delay-s", type=float, default=env_default("drain_delay_s", DEFAULT_DRAIN_DELAY_S),
                        help="on SIGTERM, keep taking calls this long while health reports NOT_SERVING, so "
                             f"routers and probes (polling every 0.5-1 s) stop sending first (default {DEFAULT_DRAIN_DELAY_S:g})")
    parser.add_argument("--metrics-port", type=int, default=env_default("metrics_port", 0),
                        help="serve Prometheus metrics on this HTTP port (0 = off)")
    parser.add_argument("--stream-idle-timeout-s", type=float, default=env_default("stream_idle_timeout_s", 120.0),
                        help=idle_timeout_help)
    parser.add_argument("--port-file", help="write the bound port here once serving (for port 0)")
    parser.add_argument("--light-load-cpus", default=env_default("light_load_cpus", ""), metavar="CPUS",
                        help=f"run on these CPUs (e.g. 1 or 0,2) while at most {LIGHT_LOAD_STREAMS} streams are open, anywhere "
                             "above (omni-serve up sets it: --cpu-layout); default: anywhere")
    add_tls_flags(parser)
    add_health_port_flag(parser)
    add_tracing_flags(parser)


def serving_config_from_args(args: argparse.Namespace) -> ServingConfig:
    return ServingConfig(
        host=args.host, port=args.port, max_message_bytes=args.max_message_mb << 20, grace_s=args.grace_s,
        drain_delay_s=args.drain_delay_s, metrics_port=args.metrics_port, stream_idle_timeout_s=args.stream_idle_timeout_s,
        tls=tls_from_args(args), health_port=args.health_port, light_load_cpus=parse_cpus(args.light_load_cpus),
        tracing=tracing_from_args(args),
    )


def add_health_port_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--health-port", type=int, default=env_default("health_port", 0),
                        help="also serve grpc.health.v1 alone, in plaintext, on this port (probes when TLS is on)")
