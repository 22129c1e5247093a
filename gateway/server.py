"""`omni-gateway`: an OpenAI-compatible HTTP API in front of the router.

The app (`create_app`) and the command. It is a gRPC client of the router and nothing else: no
model, no torch. Each endpoint is a file (docs/gateway.md: chat.py, speech.py, models.py); the
caller's `Authorization: Bearer` header is passed on as gRPC metadata, gRPC statuses become
OpenAI-shaped errors (errors.py), and a caller that goes away cancels its gRPC call, which frees
the request in every stage (router_call.py).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import chat, client_secrets, models, realtime, speech
from gateway.asgi import BearerAuth, CountAndLimit, IncompleteFilter, metrics_wsgi_app
from gateway.config import GatewayConfig, config_from_args
from gateway.errors import APIError, from_validation
from gateway.process import Gateway
from gateway.router_call import ClientGone
from services.base.env import env_default, env_flag
from services.base.errors import UserError, run_cli
from services.serving.gc_heap import freeze_startup_heap
from services.serving.grpc_server import setup_logging
from services.serving.security import add_tls_flags
from services.serving.tracing import add_tracing_flags, tracing_from_args
from services.serving.tracing import setup as setup_tracing

log = logging.getLogger("gateway")


def create_app(config: GatewayConfig) -> FastAPI:
    gateway = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.open()
        yield
        await gateway.close()

    app = FastAPI(title="omni-gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.add_middleware(CountAndLimit, requests=gateway.metrics.requests, max_body_bytes=config.max_body_bytes)
    # Outermost: a caller without a token is refused before its body is read or counted.
    app.add_middleware(BearerAuth, tokens=config.auth_tokens, open_paths=models.OPEN_PATHS, denied=lambda: APIError(
        401, "missing or invalid bearer token (Authorization: Bearer <token>)", "invalid_request_error", None,
        "invalid_api_key", {"WWW-Authenticate": "Bearer"}).response(), secret_ok=realtime.secret_ok(config))
    _add_error_handlers(app)
    for endpoints in (chat.routes, speech.routes, models.routes, realtime.routes, client_secrets.routes):
        app.include_router(endpoints)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body: ours, pydantic's (422 -> 400 naming the field), Starlette's;
    a client gone before its response, 499."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return from_validation(exc.errors()).response()

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nobody to send it to; the call is cancelled everywhere

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()


def listen_socket(host: str, port: int, send_buffer_bytes: int = 256 << 10) -> socket.socket:
    """The bound listening socket uvicorn serves on (port 0: any free one).

    proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    accepted sockets inherit this one's proto. Without it every SSE event after the headers waits
    for the client's delayed ACK (about 40 ms on Linux) once a kept-alive connection is reused."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit a fixed send buffer: with Linux's autotuning (up to tcp_wmem's 4 MB) a
    # client that stops reading left seconds of audio in the kernel before a write blocked and the
    # send timeout could see it. 256 kB is 4 s of SSE pcm16 audio at 24 kHz, and 2.5 MB/s at 100 ms RTT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind((host, port))
    return sock


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--router", default=env_default("router", "localhost:50051"), help="router host:port")
    parser.add_argument("--sessions", default=env_default("sessions", "localhost:50052"),
                        help="the sessions service's replicas (omni-session) /v1/realtime's sessions go to: "
                             "host:port[,host:port] or dns:///name:port; each new session to the least loaded healthy "
                             "one that is not draining (default localhost:50052)")
    parser.add_argument("--host", default=env_default("host", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=env_default("http_port", 8000),
                        help="HTTP port (default 8000; 0 = any free port, see --port-file)")
    parser.add_argument("--checkpoint", default=env_default("checkpoint", None),
                        help="read the model name, family and voices from this checkpoint's config.json (JSON "
                             "only: a Qwen2.5-Omni checkpoint's voices come with --voices)")
    parser.add_argument("--model-name", default=env_default("model_name", None),
                        help="the model id /v1/models lists (default: the checkpoint folder's name, or qwen3-omni)")
    parser.add_argument("--voices", default=env_default("voices", None),
                        help="comma-separated voices (default: the checkpoint's speakers; none = the router checks)")
    parser.add_argument("--timeout-s", type=float, default=env_default("timeout_s", 600.0),
                        help="deadline of every router call (default 600)")
    parser.add_argument("--max-message-mb", type=int, default=env_default("max_message_mb", 64),
                        help="largest gRPC message to or from the router (default 64)")
    parser.add_argument("--max-body-mb", type=int, default=env_default("max_body_mb", 96),
                        help="largest HTTP request body; over it: 413 (default 96)")
    parser.add_argument("--metrics-port", type=int, default=env_default("metrics_port", 0),
                        help="also serve Prometheus metrics on this port (0 = only /metrics on --port)")
    parser.add_argument("--grace-s", type=float, default=env_default("grace_s", 30.0),
                        help="on SIGTERM: stop accepting, give open streams this long (default 30)")
    parser.add_argument("--port-file", help="write the bound port here once listening")
    parser.add_argument("--auth-token-file", default=env_default("auth_token_file", None),
                        help="bearer tokens callers must present (one per line; also OMNI_AUTH_TOKENS, comma-"
                             "separated): every route but /live and /health, /metrics and --metrics-port included")
    parser.add_argument("--require-auth", action="store_true", default=env_flag("require_auth"),
                        help="refuse to start without tokens (Kubernetes: no open port by mistake)")
    parser.add_argument("--send-timeout-s", type=float, default=env_default("send_timeout_s", 30.0),
                        help="a streamed response whose client takes no bytes for this long is ended and its "
                             "router call cancelled (default 30)")
    parser.add_argument("--send-buffer-kb", type=int, default=env_default("send_buffer_kb", 256),
                        help="kernel send buffer of each client connection (default 256: 4 s of streamed "
                             "audio; smaller: a client that stops reading is noticed sooner)")
    parser.add_argument("--max-audio-seconds", type=float, default=env_default("max_audio_seconds", 300.0),
                        help="longest mp3 input audio part, decoded here (default 300, the thinker's default)")
    parser.add_argument("--router-refresh-s", type=float, default=env_default("router_refresh_s", 60.0),
                        help="open a new channel to the router this often, so that a DNS name's new router "
                             "pods get calls (default 60; calls go round robin over its addresses)")
    add_tls_flags(parser)
    add_tracing_flags(parser)
    return parser


def serve_metrics(host: str, port: int, registry, tokens: tuple[bytes, ...]) -> None:
    """`--metrics-port`: Prometheus metrics on a port of their own, from a thread (WSGI)."""
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = make_server(host, port, metrics_wsgi_app(registry, tokens), handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()


def serve(config: GatewayConfig, args: argparse.Namespace) -> None:
    import uvicorn

    setup_logging("gateway", args.log_format)
    setup_tracing("gateway", tracing_from_args(args), args.port)
    logging.getLogger("uvicorn.error").addFilter(IncompleteFilter())
    try:
        sock = listen_socket(config.host, config.port, args.send_buffer_kb << 10)
    except OSError as exc:
        raise UserError(f"cannot listen on {config.host}:{config.port}: {exc}") from None
    port = sock.getsockname()[1]
    app = create_app(config)
    if args.metrics_port:
        serve_metrics(config.host, args.metrics_port, app.state.gateway.metrics.registry, config.auth_tokens)
    # Keep-alive longer than the usual 60 s idle timeout of load balancers, so they close first.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=75,
                                           timeout_graceful_shutdown=args.grace_s))
    tokens = config.auth_tokens
    log.info("omni-gateway on %s:%d -> router %s (model %s, voices %s, %s)", config.host, port, config.router,
             config.model, ",".join(config.voices) or "?", f"{len(tokens)} tokens" if tokens else "no token check")
    log.info("froze %d start-up objects out of garbage collection", freeze_startup_heap())
    if args.port_file:
        Path(args.port_file).write_text(str(port))
    server.run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(lambda: serve(config_from_args(args), args))


if __name__ == "__main__":
    sys.exit(main())
