"""A replica that has just come back, seen from the stage above it, over real gRPC on loopback.

The router routes to a restarted replica as soon as its own health check sees it; the stage above
may still hold a channel to that address in its reconnect backoff, on which a call fails at once.
Reading the replica's limits at admission (services/serving/peer_limits.py) and opening a stream
on it (ChannelPool.wait_ready, before Downstream opens or moves a stream) wait for the channel
instead; a request whose primary is gone reads its fallback's limits."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from omni.v1 import common_pb2
from services.serving.channels import ChannelPool
from services.serving.peer_limits import PeerLimits
from services.serving.status import StageUnavailable
from services.tools.launcher import free_port

LIMITS = common_pb2.StageLimits(max_model_len=4096, max_new_tokens_limit=2048)


async def serve_load(port: int = 0) -> tuple[grpc.aio.Server, int]:
    """A gRPC server that answers Talker.GetLoad with LIMITS (only the method a PeerLimits calls)."""
    async def get_load(request, context):
        return common_pb2.LoadReport(stage="talker", limits=LIMITS)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("omni.v1.Talker", {
        "GetLoad": grpc.unary_unary_rpc_method_handler(
            get_load, request_deserializer=common_pb2.LoadRequest.FromString,
            response_serializer=common_pb2.LoadReport.SerializeToString)}),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def wait_state(channel: grpc.aio.Channel, state: grpc.ChannelConnectivity, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (now := channel.get_state(try_to_connect=True)) is not state:
        assert time.monotonic() < deadline, now
        await asyncio.wait_for(channel.wait_for_state_change(now), deadline - time.monotonic())


async def backing_off(channels: ChannelPool) -> tuple[str, grpc.aio.Channel]:
    """An address nothing listens on yet, and the pool's channel to it in TRANSIENT_FAILURE."""
    address = f"127.0.0.1:{free_port()}"
    channel = channels.get(address)
    await wait_state(channel, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
    return address, channel


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_a_replica_back_while_the_channel_backs_off_is_read():
    """The CI failure of the migration suite: the router saw a restarted talker healthy, the
    thinker's channel to it was still in TRANSIENT_FAILURE, and a call failed at once."""
    async def scenario():
        channels = ChannelPool()
        try:
            # The channel retries every 0.25-1.2 s: on a loaded host a retry can land between the
            # server's start and the read, and then the read proves nothing. Such a try starts over.
            for _ in range(5):
                address, channel = await backing_off(channels)
                server, _ = await serve_load(port_of(address))
                try:
                    if channel.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE:  # still backing off
                        return await PeerLimits("talker", channels).get(address)
                finally:
                    await server.stop(0)
            raise AssertionError("the channel reconnected before every read: no read on a backing-off channel")
        finally:
            await channels.close()

    assert asyncio.run(scenario()) == LIMITS


def test_a_dead_primary_s_limits_are_read_from_its_fallback_and_none_answering_names_the_primary():
    async def scenario():
        channels = ChannelPool()
        server, port = await serve_load()
        dead, alive = f"127.0.0.1:{free_port()}", f"127.0.0.1:{port}"
        limits = PeerLimits("talker", channels, timeout_s=0.5)
        try:
            got = await limits.first_of([dead, alive])
            with pytest.raises(StageUnavailable) as failure:
                await limits.first_of([dead, f"127.0.0.1:{free_port()}"])
            return got, failure.value, dead
        finally:
            await server.stop(0)
            await channels.close()

    got, failure, dead = asyncio.run(scenario())
    assert got == LIMITS
    assert (failure.stage, failure.replica) == ("talker", dead) and "cannot read its limits" in str(failure)


def test_a_stream_waits_for_a_channel_in_backoff_to_connect_and_not_for_a_replica_that_is_down():
    async def scenario():
        channels = ChannelPool()
        address, channel = await backing_off(channels)
        server, _ = await serve_load(port_of(address))
        try:
            await channels.wait_ready(address, timeout_s=10.0)  # the default 1.5 s, with room for a loaded host
            back = channel.get_state()
            down, _ = await backing_off(channels)
            started = time.monotonic()
            await channels.wait_ready(down, timeout_s=0.5)  # returns: the call that follows fails as before
            return back, time.monotonic() - started
        finally:
            await server.stop(0)
            await channels.close()

    back, waited = asyncio.run(scenario())
    assert back is grpc.ChannelConnectivity.READY
    assert 0.5 <= waited < 5.0
