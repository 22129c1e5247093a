"""The gateway's HTTP plumbing below FastAPI: a streamed response tied to its router call, and the
bearer-token check in front of every route, the response count and the body-size limit.

A streamed response (`CallStream`) ends its router call however it ends, which frees the request in
every stage: the body done, the client gone (noticed at once: a task waits on `http.disconnect`
the whole time, not only between events), a client that stops reading (one write blocked longer
than `send_timeout_s`: its TCP window stayed shut), or a failure. A stream that cannot complete
(the router call failed after the headers went out, or the audio was cut) is ended without HTTP's
final chunk, so the client sees an incomplete body (httpx: RemoteProtocolError), never a short
response that looks whole.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from prometheus_client import Counter
from starlette.responses import StreamingResponse
from starlette.websockets import WebSocket

from gateway.errors import APIError

log = logging.getLogger("gateway")
# uvicorn logs this at ERROR when a response ends without its final chunk: for a CallStream that is
# the intended signal, already logged by the gateway as a warning with its reason.
INCOMPLETE_MESSAGE = "ASGI callable returned without completing response."


def sse(payload: dict) -> str:
    """One server-sent event of a JSON payload."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class StreamBroken(Exception):
    """Raised by a CallStream's body: end the response without its final chunk (logged: the reason)."""


class _ClientGone(Exception):
    pass


class CallStream(StreamingResponse):
    def __init__(self, call, content, media_type: str, send_timeout_s: float, headers: dict | None = None):
        super().__init__(content, media_type=media_type, headers=headers)
        self.router_call = call
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope, receive, send):
        gone = asyncio.Event()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                    self.router_call.cancel()  # frees the pipeline now, whatever the body is doing
                    return

        async def write(message: dict) -> None:
            if gone.is_set():
                raise _ClientGone
            try:
                async with asyncio.timeout(self.send_timeout_s):  # a timer: wait_for made a task for every chunk
                    await send(message)
            except TimeoutError:
                log.warning("client stopped reading for %.0f s: ending its stream", self.send_timeout_s)
                raise _ClientGone from None
            except OSError:  # uvicorn's ClientDisconnect
                raise _ClientGone from None

        watcher = asyncio.create_task(watch())
        try:
            await write({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for piece in self.body_iterator:
                if piece:
                    await write({"type": "http.response.body",
                                 "body": piece.encode() if isinstance(piece, str) else piece, "more_body": True})
            await write({"type": "http.response.body", "body": b"", "more_body": False})
        except _ClientGone:
            pass
        except asyncio.CancelledError:
            # Reading a grpc.aio call cancelled because the client left raises CancelledError: how
            # the call ended, not an order to stop this task (then re-raised).
            task = asyncio.current_task()
            if not gone.is_set() or (task is not None and task.cancelling()):
                raise
        except StreamBroken as broken:
            log.warning("stream ended incomplete: %s", broken)
        finally:
            watcher.cancel()
            self.router_call.cancel()
            await self.body_iterator.aclose()


class IncompleteFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != INCOMPLETE_MESSAGE


def authorized(header: bytes | str | None, tokens: tuple[bytes, ...]) -> bool:
    """`Authorization: Bearer <token>` against the known tokens, in constant time each."""
    if isinstance(header, str):
        header = header.encode()
    presented = header[len(b"Bearer "):] if header and header.startswith(b"Bearer ") else b""
    return bool(presented) and any([hmac.compare_digest(presented, token) for token in tokens])


class BearerAuth:
    """Plain ASGI middleware: with tokens configured, every route but the probes (`open_paths`) needs
    `Authorization: Bearer <token>`; else 401 in OpenAI's shape, before the body is read (a
    WebSocket's handshake is answered with the 401 instead of being upgraded). `secret_ok(scope)`
    lets a WebSocket in with a client secret instead, where it says so (gateway/client_secrets.py)."""

    def __init__(self, app, tokens: tuple[bytes, ...], open_paths: tuple[str, ...], denied,
                 secret_ok=lambda scope: False):
        self.app = app
        self.tokens = tokens
        self.open_paths = open_paths
        self.denied = denied  # () -> the 401 response
        self.secret_ok = secret_ok

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or not self.tokens or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers", ())).get(b"authorization")
        if authorized(header, self.tokens) or (scope["type"] == "websocket" and self.secret_ok(scope)):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await WebSocket(scope, receive, send).send_denial_response(self.denied())
        return await self.denied()(scope, receive, send)


def metrics_wsgi_app(registry, tokens: tuple[bytes, ...]):
    """prometheus_client's WSGI app, behind the same tokens (the separate --metrics-port)."""
    from prometheus_client import make_wsgi_app

    inner = make_wsgi_app(registry)

    def app(environ, start_response):
        if tokens and not authorized(environ.get("HTTP_AUTHORIZATION"), tokens):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"missing or invalid bearer token\n"]
        return inner(environ, start_response)

    return app


class CountAndLimit:
    """Plain ASGI middleware (streamed responses pass straight through): counts responses per endpoint and
    status, and refuses request bodies over the limit with 413 before they are read whole."""

    ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/audio/speech": "speech"}

    def __init__(self, app, requests: Counter, max_body_bytes: int):
        self.app = app
        self.requests = requests  # omni_gateway_requests_total{endpoint, status}
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = self.ENDPOINTS.get(scope["path"])

        async def counting_send(message):
            if message["type"] == "http.response.start" and endpoint is not None:
                self.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        too_large = APIError(413, f"request body over {self.max_body_bytes >> 20} MB", "invalid_request_error",
                             None, "request_too_large")
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await too_large.response()(scope, receive, counting_send)
        if length is None and scope.get("method") == "POST":
            # A chunked body: read it here (FastAPI reads it whole anyway), up to the limit, then
            # hand it on as one message.
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
                if size > self.max_body_bytes:
                    return await too_large.response()(scope, receive, counting_send)
            replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

            async def replaying_receive():
                return replay.pop() if replay else await receive()
        else:
            replaying_receive = receive
        await self.app(scope, replaying_receive, counting_send)
