"""A stream to the next stage opened, or moved, on a replica that has just come back, over real
gRPC on loopback: `Downstream.open` and `Downstream.recover` (services/serving/migration.py) wait
for the pool's channel to that address to leave its reconnect backoff (ChannelPool.wait_ready)
before they open the call.

Pinned bugs: `Downstream.open` skipping that wait (project issue 48, item 0), and `recover` skipping
it (issue 58: the open test covered `open` alone). The wait itself is tested
(tests/serving/test_peer_readiness.py), its use by the stream was not: a call on a channel still in
TRANSIENT_FAILURE fails at once, and the request would move to a fallback (or fail) for nothing.
"""

from __future__ import annotations

import asyncio

import grpc

from omni.v1 import common_pb2
from services.serving.channels import ChannelPool
from services.serving.engine_loop import EventSink
from services.serving.migration import Downstream
from services.serving.status import StageUnavailable
from services.tools.launcher import free_port
from tests.serving.test_peer_readiness import backing_off, port_of

METHOD = "/omni.test.Next/Stream"
REPLY = common_pb2.LoadReport(stage="talker", running=7)


async def serve_stream(port: int) -> grpc.aio.Server:
    """A next stage that answers every stream with REPLY, its final message."""
    async def stream(requests, context):
        yield REPLY

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("omni.test.Next", {
        "Stream": grpc.stream_stream_rpc_method_handler(
            stream, request_deserializer=common_pb2.LoadRequest.FromString,
            response_serializer=common_pb2.LoadReport.SerializeToString)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def downstream(channels: ChannelPool, replicas: list[str], sink: EventSink) -> Downstream:
    """A thinker's stream to the talker over `replicas` (primary first), one move allowed."""
    return Downstream("thinker", "talker", replicas,
                      lambda a: channels.get(a).stream_stream(
                          METHOD, request_serializer=common_pb2.LoadRequest.SerializeToString,
                          response_deserializer=common_pb2.LoadReport.FromString)(),
                      sink, is_final=lambda _: True, max_moves=1, wait_ready=channels.wait_ready)


def test_a_stream_opened_on_a_replica_back_while_its_channel_backs_off_gets_its_replies():
    async def scenario():
        channels = ChannelPool()
        try:
            # The channel retries every 0.25-1.2 s: a retry that lands between the server's start and
            # the open proves nothing (the channel is no longer backing off). Such a try starts over.
            for _ in range(5):
                address, channel = await backing_off(channels)
                server = await serve_stream(port_of(address))
                sink = EventSink(asyncio.get_running_loop())
                stream = downstream(channels, [address], sink)
                try:
                    if channel.get_state() is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                        continue
                    await stream.open()
                    return await sink.get(idle_timeout_s=10.0, stage="talker")
                finally:
                    stream.cancel()
                    await server.stop(0)
            raise AssertionError("the channel reconnected before every open: no open on a backing-off channel")
        finally:
            await channels.close()

    assert asyncio.run(scenario()) == REPLY


def test_a_stream_moved_to_a_fallback_back_while_its_channel_backs_off_gets_its_replies():
    """The primary replica dies (its StageUnavailable) and the fallback has just come back: the
    move's call waits for the fallback's channel, so the replay gets the fallback's replies instead
    of an UNAVAILABLE that would fail the request with its last fallback up."""
    async def scenario():
        channels = ChannelPool()
        try:
            for _ in range(5):  # as above: a try whose channel reconnected before the move starts over
                primary = f"127.0.0.1:{free_port()}"
                primary_server = await serve_stream(port_of(primary))
                fallback, channel = await backing_off(channels)
                server = await serve_stream(port_of(fallback))
                sink = EventSink(asyncio.get_running_loop())
                stream = downstream(channels, [primary, fallback], sink)
                try:
                    await stream.open()
                    assert await sink.get(idle_timeout_s=10.0, stage="talker") == REPLY  # the primary's
                    if channel.get_state() is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                        continue
                    assert await stream.recover(StageUnavailable("talker", primary, "died"))
                    assert stream.replica == fallback
                    return await sink.get(idle_timeout_s=10.0, stage="talker")
                finally:
                    stream.cancel()
                    await server.stop(0)
                    await primary_server.stop(0)
            raise AssertionError("the channel reconnected before every move: no move onto a backing-off channel")
        finally:
            await channels.close()

    assert asyncio.run(scenario()) == REPLY
