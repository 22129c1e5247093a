"""omni-session: the sessions service, `omni.v1.Sessions/Session` (docs/sessions.md).

Realtime voice sessions in a process of their own, between the gateway and the router: each session
keeps its conversation and input audio, runs turn detection, and sends each turn to the router as an
ordinary `Omni/Generate` call (sessions/router_client.py), so the router only admits and balances.
A replica takes up to --max-sessions sessions (RESOURCE_EXHAUSTED beyond, before any event), reports
how many it holds on `GetLoad` (the gateway sends a new session to the least loaded replica), and on
SIGTERM turns NOT_SERVING, takes no new session, and lets the open ones run for the grace period.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc

from omni.v1 import common_pb2, omni_pb2, omni_pb2_grpc
from services.base.env import env_default
from services.base.errors import run_cli
from services.serving import loop_lag
from services.serving.config import add_serving_flags, serving_config_from_args
from services.serving.grpc_server import (
    ServerHandle,
    build_server,
    channel_options,
    run_process,
    serve_until_signal,
    write_port_file,
)
from services.serving.security import BearerTokenInterceptor, load_tokens
from services.serving.status import Overloaded, abort_for
from sessions.config import DEFAULT_PORT, SessionConfig, SessionsConfig, parse_routers
from sessions.metrics import SessionMetrics
from sessions.router_client import RouterClient
from sessions.session import RealtimeSession
from sessions.turn_detection import onnx_model, silero

log = logging.getLogger("sessions")
SERVICE = omni_pb2.DESCRIPTOR.services_by_name["Sessions"].full_name
LOAD_NAME = "sessions"  # LoadReport.stage


class SessionsServicer(omni_pb2_grpc.SessionsServicer):
    def __init__(self, config: SessionsConfig, router: RouterClient, metrics: SessionMetrics):
        self.config = config
        self.router = router
        self.metrics = metrics
        self.open = 0  # sessions open on this replica
        # Turn detection off the event loop: one thread for every session of the replica (a window
        # costs about 0.13 ms of CPU on the model, so one thread keeps up
        # with hundreds of speakers); each session waits for its own append's detection, so its
        # windows stay in order.
        self.detection = ThreadPoolExecutor(1, thread_name_prefix="turn-detection")
        self.handle: ServerHandle | None = None  # set once built: whether it drains

    async def Session(self, requests, context: grpc.aio.ServicerContext) -> None:
        if self.open >= self.config.max_sessions:
            self.metrics.sessions.labels("rejected").inc()
            await abort_for(context, Overloaded(
                f"sessions replica at capacity: {self.open} of {self.config.max_sessions} sessions open "
                "(--max-sessions)", self.config.retry_after_s))
        self.open += 1
        try:
            await RealtimeSession(self.router, self.metrics, requests, context, self.config.session, silero,
                                  self.detection).run()
        finally:
            self.open -= 1

    async def GetLoad(self, request: common_pb2.LoadRequest, context: grpc.aio.ServicerContext) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(stage=LOAD_NAME, running=self.open, in_flight=self.open,
                                     draining=self.handle is not None and self.handle.draining)


async def create_server(config: SessionsConfig) -> tuple[ServerHandle, SessionsServicer]:
    # Turn detection's model loads before the service is ready (onnxruntime's import and the
    # session: 2 s of wall time here), not in the first session's start on the event loop.
    onnx_model()
    metrics = SessionMetrics()
    serving = config.serving
    router = RouterClient(config.routers, serving.tls, channel_options(serving.max_message_bytes), metrics)
    servicer = SessionsServicer(config, router, metrics)
    interceptors = (BearerTokenInterceptor(config.auth_tokens),) if config.auth_tokens else ()
    # No BDP probing: HTTP/2's window stays at its initial 64 KiB instead of growing to many MiB
    # (9 to 17 measured), so a client that sends faster than its session handles is held back by
    # the bounded inbox plus less than one append (audio arrives at 2x real time at most: a large
    # window buys nothing).
    handle = build_server(serving.host, serving.port, (SERVICE,), serving.max_message_bytes, tls=serving.tls,
                          interceptors=interceptors, health_port=serving.health_port,
                          options=(("grpc.http2.bdp_probe", 0),))
    servicer.handle = handle
    omni_pb2_grpc.add_SessionsServicer_to_server(servicer, handle.server)
    metrics.serve(serving.metrics_port)
    return handle, servicer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-session", description=__doc__.splitlines()[0])
    # A session's messages are a client's: 20-100 ms of audio each, an append at most 1 MiB.
    add_serving_flags(parser, default_port=DEFAULT_PORT, max_message_mb=64)
    parser.add_argument("--router", default=env_default("router", "localhost:50051"),
                        help="the routers each turn goes to: host:port[,host:port] or dns:///name:port (every "
                             "address, round robin); a turn whose router is unavailable is sent once to the next")
    parser.add_argument("--max-sessions", type=int, default=env_default("max_sessions", 256),
                        help="sessions open at once on this replica; the next is refused (default 256)")
    parser.add_argument("--auth-token-file", default=env_default("auth_token_file", None),
                        help="bearer tokens callers must present, one per line (also OMNI_AUTH_TOKENS, "
                             "comma-separated); none given = no authentication. A caller's token goes on to the router")
    parser.add_argument("--session-idle-timeout-s", type=float, default=env_default("session_idle_timeout_s", 300.0),
                        help="a session with no client message and no response this long is closed (default 300)")
    parser.add_argument("--session-max-duration-s", type=float, default=env_default("session_max_duration_s", 3600.0),
                        help="a session open this long is closed, its response in progress cancelled (default 3600)")
    parser.add_argument("--session-max-turns", type=int, default=env_default("session_max_turns", 200),
                        help="responses a session may create; the next closes it (default 200)")
    parser.add_argument("--session-max-input-s", type=float, default=env_default("session_max_input_s", 60.0),
                        help="seconds of audio a session's input buffer may hold; an append past it is refused (default 60)")
    parser.add_argument("--session-max-image-mb", type=int, default=env_default("session_max_image_mb", 8),
                        help="MiB an image part of a user item may hold; a larger one is refused (default 8)")
    parser.add_argument("--max-input-realtime", type=float, default=env_default("max_input_realtime", 2.0),
                        help="input audio faster than this many times real time is refused with an error event, "
                             "after the first --input-burst-s seconds (default 2; 0 = no bound)")
    parser.add_argument("--input-burst-s", type=float, default=env_default("input_burst_s", 10.0),
                        help="seconds of audio a session may send at once before --max-input-realtime holds (default 10)")
    parser.add_argument("--session-send-timeout-s", type=float, default=env_default("session_send_timeout_s", 10.0),
                        help="a session whose client takes no event this long is closed and its response cancelled "
                             "(default 10)")
    parser.add_argument("--early-response", action=argparse.BooleanOptionalAction, default=True,
                        help="start each detected turn's answer once its speech went quiet (--early-response-after-ms), "
                             "held back until the silence setting confirms the turn, dropped if the speech resumes "
                             "(default on)")
    parser.add_argument("--early-response-after-ms", type=int, default=32,
                        help="how long the speech must have been quiet before its answer starts, in 32 ms windows "
                             "(rounded up; default 32: the first silent window). Longer starts fewer answers that "
                             "the speech's pauses drop again, and leaves less of the silence setting to make it")
    return parser


def config_from_args(args: argparse.Namespace) -> SessionsConfig:
    return SessionsConfig(
        routers=parse_routers(args.router), serving=serving_config_from_args(args), max_sessions=args.max_sessions,
        auth_tokens=load_tokens(args.auth_token_file),
        session=SessionConfig(idle_timeout_s=args.session_idle_timeout_s, max_duration_s=args.session_max_duration_s,
                              max_turns=args.session_max_turns,
                              max_input_s=args.session_max_input_s, send_timeout_s=args.session_send_timeout_s,
                              max_image_bytes=args.session_max_image_mb << 20,
                              max_input_realtime=args.max_input_realtime, input_burst_s=args.input_burst_s,
                              early_response=args.early_response,
                              early_response_after_ms=args.early_response_after_ms),
    )


async def serve(config: SessionsConfig, port_file: str | None = None) -> None:
    """Serve until SIGTERM: ready at once (a session needs the router only at its first turn)."""
    handle, servicer = await create_server(config)
    lag = asyncio.get_running_loop().create_task(loop_lag.watch(servicer.metrics.loop_lag))
    await serve_until_signal(handle, config.serving.grace_s, drain_delay_s=config.serving.drain_delay_s,
                             on_started=lambda: write_port_file(port_file, handle.port),
                             light_load_cpus=config.serving.light_load_cpus)
    lag.cancel()
    await servicer.router.close()
    servicer.detection.shutdown(wait=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    return run_cli(lambda: run_process("sessions", serve, config_from_args(args), args.port_file))


if __name__ == "__main__":
    sys.exit(main())
