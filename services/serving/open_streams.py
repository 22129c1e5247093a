"""Every open stream of a stage's own service, counted where gRPC hands it to the servicer.

The engine loop knows the requests its engine holds; a stream lives longer (the thinker relays
the talker's audio after its text is done; a stream waits for its first input). `LoadReport.
in_flight` is "streams open on this replica", so it is counted here, from the moment the
handler starts to the moment it returns, whatever way it ends: a leaked stream shows.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import aclosing

import grpc

# A process with at most this many streams open is lightly loaded: there the thinker holds text
# for audio first (services/thinker/server.py) and a process runs on its light-load CPUs
# (placement.py); above it the stages are busy anyway and both only cost throughput.
LIGHT_LOAD_STREAMS = 4


class OpenStreams(grpc.aio.ServerInterceptor):
    """Counts the open streaming calls of `service_names` (health and reflection not included)."""

    def __init__(self, service_names: tuple[str, ...]):
        self.prefixes = tuple(f"/{name}/" for name in service_names)
        self.open = 0
        self.peak = 0  # the most open at once since the start or the last reset (LoadReport.in_flight_peak)
        self.opened = 0  # streams opened since the start (LoadReport.streams_total)
        self.on_change: Callable[[int], None] | None = None  # called with the new count (placement.py)

    def take_peak(self, reset: bool = False) -> int:
        """The most streams open at once since the start or the last reset; `reset` starts a new
        mark from the streams open now."""
        peak = self.peak
        if reset:
            self.peak = self.open
        return peak

    def _count(self, delta: int) -> None:
        self.open += delta
        if delta > 0:
            self.opened += delta
            self.peak = max(self.peak, self.open)
        if self.on_change is not None:
            self.on_change(self.open)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or not hasattr(handler, "_replace") or not handler.response_streaming
                or not handler_call_details.method.startswith(self.prefixes)):
            return handler
        kind = "stream_stream" if handler.request_streaming else "unary_stream"
        inner = getattr(handler, kind)
        if inspect.isasyncgenfunction(inner):
            async def counted(request, context):
                self._count(1)
                try:
                    async with aclosing(inner(request, context)) as responses:
                        async for response in responses:
                            yield response
                finally:
                    self._count(-1)
        else:
            async def counted(request, context):
                self._count(1)
                try:
                    return await inner(request, context)
                finally:
                    self._count(-1)
        return handler._replace(**{kind: counted})
