"""One `Omni/Generate` call of the router, started, watched and read (`Call`), on the process's
channel (gateway/process.py). A call's failure becomes an OpenAI error through gateway/errors.py; a
caller that goes away cancels the call, which frees the request in every stage.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import grpc
from fastapi import Request

from gateway.errors import APIError, from_rpc
from gateway.process import Gateway
from omni.v1 import omni_pb2
from services.serving import tracing
from services.serving.streams import read


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
