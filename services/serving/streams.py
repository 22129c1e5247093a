"""Talking to the next stage over a bidirectional stream: writes that never raise, and a relay of
its responses that says how the stream ended.

NOTE: a downstream stage may end its stream while we are still writing (the talker reaches its
own max tokens while the thinker still streams text). grpc aio then fails the write and may
report its own local error as the call's status, hiding the stage's real one. So writes are
best-effort and the relay alone decides: everything up to the stage's final message counts, and
whatever status follows it does not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from services.serving.engine_loop import EventSink
from services.serving.status import StageUnavailable, failure_of_call


async def write_quietly(call, message) -> bool:
    """Write `message` to a downstream stream; False once the stream has ended."""
    if call.done():
        return False
    try:
        await call.write(message)
        return True
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        return False  # the relay reports how the stream ended


async def close_quietly(call) -> None:
    if not call.done():
        try:
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass


async def relay_responses(call, stage: str, replica: str, sink: EventSink, is_final: Callable[[object], bool],
                          on_response: Callable[[], None] | None = None) -> None:
    """Put every response into `sink` up to the final one; any other end fails the sink:
    StageUnavailable naming `stage` for a dead or vanished peer, else the stage's own status.
    `on_response` is called on each response (progress, for a stall watch)."""
    try:
        async for response in call:
            if on_response is not None:
                on_response()
            sink.downstream(response)
            if is_final(response):
                return
        status = await call.code()
        if status is grpc.StatusCode.OK:
            raise StageUnavailable(stage, replica, "the stream ended without a final message")
        raise grpc.aio.AioRpcError(status, None, await call.trailing_metadata(), await call.details())
    except grpc.aio.AioRpcError as exc:
        sink.fail(failure_of_call(stage, replica, exc))
    except StageUnavailable as exc:
        sink.fail(exc)
