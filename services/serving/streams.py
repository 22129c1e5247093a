"""Talking to the next stage over a bidirectional stream: writes that never raise, and a relay of
its responses that says how the stream ended.

NOTE: a downstream stage may end its stream while we are still writing (the talker reaches its
own max tokens while the thinker still streams text). grpc aio then fails the write and may
report its own local error as the call's status, hiding the stage's real one. So writes are
best-effort and the relay alone decides: everything up to the stage's final message counts, and
whatever status follows it does not.

NOTE: no task that is waiting on a gRPC read is ever cancelled here. grpc.aio never frees the
native batch of a read whose awaiting task is cancelled (grpc/grpc#43360, open with fixes
proposed): measured with grpcio 1.85.3 on a 2-core Xeon, a bare server whose bidi handler
cancelled its pending reader task kept +130-195 B of malloc in-use memory per stream, and +1-31 B
when the task was left to end; a bare client cancelling its read, ~316 B against ~45 B. So a
stream is given up by cancelling its call, after which the pending read returns at once, and
the task reading it ends by itself (`let_end`, `read`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from services.serving.engine_loop import EventSink
from services.serving.status import StageUnavailable, failure_of_call

DRAIN_S = 5.0  # a cancelled call's pending read returns at once; this only bounds a broken one

_ending: set[asyncio.Future] = set()  # tasks left to end by themselves (asyncio keeps tasks weakly)


def let_end(task: asyncio.Future) -> None:
    """Leave `task`, which may be waiting on a read, to end by itself instead of cancelling it
    (see the NOTE above); how it ends is retrieved, so asyncio logs nothing about it."""
    if task.done():
        _retrieve(task)
        return
    _ending.add(task)
    task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future) -> None:
    _ending.discard(task)
    if not task.cancelled():
        task.exception()


async def read(call, stall_s: float | None = None, stalled: Callable[[], BaseException] | None = None):
    """`await call.read()` (a message, or grpc.aio.EOF), safe to cancel: the read runs in a task
    of its own, and when the caller is cancelled, or no message comes within `stall_s` (then
    `stalled()` is raised), the call is cancelled and the read left to end by itself."""
    pending = asyncio.ensure_future(call.read())
    try:
        done, _ = await asyncio.wait((pending,), timeout=stall_s)
    except asyncio.CancelledError:
        await _give_up(call, pending)
        raise
    if not done:
        await _give_up(call, pending)
        raise stalled()
    return pending.result()


async def _give_up(call, pending: asyncio.Future) -> None:
    call.cancel()
    let_end(pending)
    await asyncio.wait((pending,), timeout=DRAIN_S)  # neither cancels the read nor waits past DRAIN_S


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


class Gate:
    """The sink as one relay sees it: shut when the stream gives up on that relay's call (a move,
    a cancel), so that the relay, left to end by itself, delivers nothing late into a sink that
    has moved on to the next replica's responses or to nobody."""

    def __init__(self, sink: EventSink):
        self._sink = sink
        self.open = True

    def downstream(self, message) -> None:
        if self.open:
            self._sink.downstream(message)

    def fail(self, exc: BaseException) -> None:
        if self.open:
            self._sink.fail(exc)


async def relay_responses(call, stage: str, replica: str, sink: EventSink | Gate, is_final: Callable[[object], bool],
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
