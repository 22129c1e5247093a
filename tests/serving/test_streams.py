"""Talking to the next stage (services/serving/streams.py): the relay trusts the final message and
turns any other end into one failure naming the stage; writes never raise; a stream given up
(a cancel, a stall, a move) is ended by cancelling its call, never a task waiting on one of its
reads (grpc.aio leaks such a read's native batch). Over real bidi streams on loopback, with
raw-bytes messages (b"final" marks the last one)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.base.errors import InvalidArgument
from services.serving import streams
from services.serving.engine_loop import EventSink
from services.serving.migration import Downstream
from services.serving.status import StageUnavailable, StreamIdle, abort_for, error_info
from services.serving.streams import close_quietly, let_end, read, relay_responses, write_quietly


def is_final(message: bytes) -> bool:
    return message == b"final"


class Spied:
    """A real call whose reads record whether the task awaiting them was cancelled (asyncio's
    `cancelling()`): grpc.aio raises CancelledError itself from a read of a call cancelled
    locally, which is fine; a task cancelled while it awaits a read is the leak."""

    def __init__(self, call):
        self.call = call
        self.cancelled_mid_read = 0
        self.responses = 0

    def __getattr__(self, name):
        return getattr(self.call, name)

    async def read(self):
        try:
            response = await self.call.read()
        except asyncio.CancelledError:
            self.cancelled_mid_read += asyncio.current_task().cancelling() > 0
            raise
        self.responses += response is not grpc.aio.EOF
        return response

    async def __aiter__(self):
        while (response := await self.read()) is not grpc.aio.EOF:
            yield response


async def endless(requests, context):
    """A peer that streams until its caller goes away."""
    i = 0
    while True:
        yield b"audio %d" % i
        i += 1
        await asyncio.sleep(0.01)


async def silent_after_one(requests, context):
    yield b"first"
    await asyncio.sleep(30)


async def with_peer(handler, body):
    """`await body(open_call, address)` with `handler(requests, context)` as the peer on loopback;
    `open_call()` opens a (spied) bidi call to it."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Peer", {"Chat": grpc.stream_stream_rpc_method_handler(handler)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await body(lambda _address="": Spied(channel.stream_stream("/test.Peer/Chat")(timeout=10)),
                              f"127.0.0.1:{port}")
    finally:
        await server.stop(0)


async def relay_against(handler, writes: int = 0):
    """Everything the relay put into the sink, with `handler(requests, context)` as the peer, and
    the peer's address."""
    async def body(open_call, address):
        call = open_call()
        sink = EventSink(asyncio.get_running_loop())
        relay = asyncio.create_task(relay_responses(call, "code2wav", address, sink, is_final))
        for i in range(writes):
            await write_quietly(call, b"w%d" % i)
        await close_quietly(call)
        await relay
        got = []
        while True:
            try:
                got.append(await sink.get(0.2))
            except Exception as exc:  # noqa: BLE001  (the failure the relay put in, or idle)
                got.append(exc)
                return got, address

    return await with_peer(handler, body)


def test_messages_up_to_the_final_one_are_relayed_and_nothing_after():
    async def peer(requests, context):
        yield b"audio 0"
        yield b"audio 1"
        yield b"final"
        await context.abort(grpc.StatusCode.INTERNAL, "a status after the final message does not count")

    got, _ = asyncio.run(relay_against(peer))
    assert got[:3] == [b"audio 0", b"audio 1", b"final"]
    assert type(got[3]).__name__ == "StreamIdle"  # the relay ended: nothing else arrives


def test_a_stream_that_ends_without_its_final_message_is_the_stage_unavailable():
    async def peer(requests, context):
        yield b"audio 0"

    got, address = asyncio.run(relay_against(peer))
    assert got[0] == b"audio 0"
    assert isinstance(got[1], StageUnavailable)
    assert (got[1].stage, got[1].replica) == ("code2wav", address)
    assert "ended without a final message" in str(got[1])


def test_a_status_the_peer_chose_passes_through_with_its_details():
    async def peer(requests, context):
        await abort_for(context, InvalidArgument("frames.num_code_groups", "must be 16, got 3"))
        yield b""  # pragma: no cover

    got, _ = asyncio.run(relay_against(peer))
    assert isinstance(got[0], grpc.aio.AioRpcError)
    assert got[0].code() is grpc.StatusCode.INVALID_ARGUMENT
    assert got[0].details() == "frames.num_code_groups: must be 16, got 3"


def test_an_unavailable_naming_a_stage_further_down_is_kept():
    async def peer(requests, context):
        await abort_for(context, StageUnavailable("vocoder-shard", "10.1.1.1:1", "gone"))
        yield b""  # pragma: no cover

    got, _ = asyncio.run(relay_against(peer))
    assert dict(error_info(got[0]).metadata) == {"stage": "vocoder-shard", "replica": "10.1.1.1:1"}


def test_writes_to_a_stream_the_peer_ended_return_false_instead_of_raising():
    async def peer(requests, context):
        yield b"final"

    async def body(open_call, _):
        call = open_call()
        assert await call.read() == b"final"
        await call.code()  # the peer's stream is over
        results = [await write_quietly(call, b"late") for _ in range(3)]
        await close_quietly(call)  # no error either
        return results

    assert asyncio.run(with_peer(peer, body)) == [False, False, False]


@pytest.mark.parametrize("writes", [0, 3])
def test_the_relay_reports_a_dead_peer_by_name(writes):
    async def scenario():
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:  # nothing listens on port 1
            call = channel.stream_stream("/test.Peer/Chat")(timeout=5)
            sink = EventSink(asyncio.get_running_loop())
            relay = asyncio.create_task(relay_responses(call, "talker", "127.0.0.1:1", sink, is_final))
            for i in range(writes):
                assert await write_quietly(call, b"w%d" % i) in (True, False)
            await relay
            with pytest.raises(StageUnavailable) as raised:
                await sink.get(1.0)
            return raised.value

    error = asyncio.run(scenario())
    assert (error.stage, error.replica) == ("talker", "127.0.0.1:1")


async def settled() -> None:
    """Until every task left to end by itself has ended (each read returns once its call is cancelled)."""
    for _ in range(100):
        if not streams._ending:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{len(streams._ending)} tasks left to end never ended")


def test_a_read_whose_caller_is_cancelled_cancels_the_call_and_ends_by_itself():
    async def body(open_call, _):
        call = open_call()
        assert await read(call) == b"first"
        reader = asyncio.create_task(read(call))
        await asyncio.sleep(0.1)  # the read is in flight: the peer sends nothing more
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await settled()
        return call

    call = asyncio.run(with_peer(silent_after_one, body))
    assert call.cancelled()
    assert call.cancelled_mid_read == 0


def test_a_read_that_stalls_raises_what_the_caller_names_and_cancels_the_call():
    async def body(open_call, address):
        call = open_call()
        assert await read(call, 5.0) == b"first"
        with pytest.raises(StreamIdle) as raised:
            await read(call, 0.2, lambda: StreamIdle("code2wav", 0.2, address))
        await settled()
        return call, raised.value

    call, error = asyncio.run(with_peer(silent_after_one, body))
    assert error.stage == "code2wav"
    assert call.cancelled()
    assert call.cancelled_mid_read == 0


def test_a_downstream_given_up_cancels_its_call_and_its_relay_delivers_nothing_more():
    async def body(open_call, address):
        calls = []
        sink = EventSink(asyncio.get_running_loop())
        downstream = Downstream("talker", "code2wav", [address], lambda a: calls.append(open_call(a)) or calls[-1],
                                sink, is_final, max_moves=0)
        await downstream.open()
        for _ in range(3):
            await sink.get(5.0)
        downstream.cancel()
        delivered = calls[0].responses  # the relay may have read more than the 3 taken
        await settled()
        late = []
        while True:
            try:
                late.append(await sink.get(0.3))
            except StreamIdle:
                break
        return calls[0], delivered, late

    call, delivered, late = asyncio.run(with_peer(endless, body))
    assert call.cancelled()
    assert call.cancelled_mid_read == 0
    assert len(late) <= delivered - 3  # what was in the sink at the cancel, and no failure or response after
    assert all(message.startswith(b"audio") for message in late)


def test_a_task_left_to_end_is_kept_until_it_does_and_its_failure_is_not_logged():
    async def scenario():
        logged = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: logged.append(context))
        gate = asyncio.Event()

        async def fails_later():
            await gate.wait()
            raise ValueError("how it ended is nobody's business")

        let_end(asyncio.create_task(fails_later()))
        assert len(streams._ending) == 1
        gate.set()
        await settled()
        import gc
        gc.collect()
        return logged

    assert asyncio.run(scenario()) == []


def test_a_moved_downstream_replays_what_it_wrote_with_the_start_the_owner_amended():
    """The talker's new replica gets the thinker's start marked a replay (TalkerStart.replay), then
    every row written before the move."""
    received: list[list[bytes]] = []  # per call: the messages the peer read

    async def recorder(requests, context):
        messages = []
        received.append(messages)
        async for message in requests:
            messages.append(message)
        yield b"final"

    async def body(open_call, address):
        sink = EventSink(asyncio.get_running_loop())
        downstream = Downstream("thinker", "talker", [address, address], open_call, sink, is_final, max_moves=1)
        await downstream.open()
        await downstream.write(b"start")
        await downstream.write(b"row 0")
        moved = await downstream.recover(StageUnavailable("talker", address, "killed"), first=b"start, a replay")
        await downstream.write(b"row 1")
        await downstream.close()
        while await sink.get(5.0) != b"final":
            pass
        return moved

    assert asyncio.run(with_peer(recorder, body)) is True
    assert received[-1] == [b"start, a replay", b"row 0", b"row 1"]
