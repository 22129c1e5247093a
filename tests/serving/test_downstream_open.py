"""A stream to the next stage opened on a replica that has just come back, over real gRPC on
loopback: `Downstream.open` (services/serving/migration.py) waits for the pool's channel to that
address to leave its reconnect backoff (ChannelPool.wait_ready) before it opens the call.

Pinned bug (project issue 48, item 0): `Downstream.open` skipping that wait. The wait itself is
tested (tests/serving/test_peer_readiness.py), its use by the stream was not: a call on a channel
still in TRANSIENT_FAILURE fails at once, and the request would move to a fallback (or fail) for
nothing.
"""

from __future__ import annotations

import asyncio

import grpc

from omni.v1 import common_pb2
from services.serving.channels import ChannelPool
from services.serving.engine_loop import EventSink
from services.serving.migration import Downstream
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
                downstream = Downstream(
                    "thinker", "talker", [address],
                    lambda a: channels.get(a).stream_stream(
                        METHOD, request_serializer=common_pb2.LoadRequest.SerializeToString,
                        response_deserializer=common_pb2.LoadReport.FromString)(),
                    sink, is_final=lambda _: True, max_moves=0, wait_ready=channels.wait_ready)
                try:
                    if channel.get_state() is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                        continue
                    await downstream.open()
                    return await sink.get(idle_timeout_s=10.0, stage="talker")
                finally:
                    downstream.cancel()
                    await server.stop(0)
            raise AssertionError("the channel reconnected before every open: no open on a backing-off channel")
        finally:
            await channels.close()

    assert asyncio.run(scenario()) == REPLY
