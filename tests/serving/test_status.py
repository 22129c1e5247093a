"""Errors become gRPC statuses in one place (services/serving/status.py), with google.rpc details a
caller reads back: BadRequest naming the field, ErrorInfo naming the failed stage and replica,
RetryInfo on overload. Checked over a real grpc.aio server on loopback."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.base.errors import InvalidArgument
from services.serving.config import ServingConfig
from services.serving.status import (
    DOMAIN,
    STAGE_UNAVAILABLE,
    STREAM_IDLE,
    EngineFailed,
    Overloaded,
    StageUnavailable,
    StreamIdle,
    WireError,
    abort_for,
    error_info,
    failure_of_call,
    field_violations,
    retry_after_s,
)

METHOD = "/test.Errors/Fail"


async def failing_call(exc: BaseException) -> grpc.aio.AioRpcError:
    """The error a client sees when a server handler ends its call with `abort_for(context, exc)`."""

    async def fail(request: bytes, context):
        await abort_for(context, exc)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Errors", {"Fail": grpc.unary_unary_rpc_method_handler(fail)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await channel.unary_unary(METHOD)(b"", timeout=10)
            return raised.value
    finally:
        await server.stop(0)


def call(exc: BaseException) -> grpc.aio.AioRpcError:
    return asyncio.run(failing_call(exc))


def test_invalid_argument_names_the_field_in_message_and_bad_request():
    err = call(InvalidArgument("thinker_sampling.top_p", "must be in (0, 1], got 1.5"))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "thinker_sampling.top_p: must be in (0, 1], got 1.5"
    assert field_violations(err) == [("thinker_sampling.top_p", "must be in (0, 1], got 1.5")]
    assert error_info(err) is None and retry_after_s(err) is None


def test_malformed_tensor_is_invalid_argument():
    err = call(WireError("4 bytes for shape [2, 3] float32"))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "malformed tensor: 4 bytes for shape [2, 3] float32"
    assert field_violations(err) == [("tensor", "4 bytes for shape [2, 3] float32")]


def test_stage_unavailable_carries_stage_and_replica_as_error_info():
    err = call(StageUnavailable("talker", "10.0.0.7:50062", "connection refused"))
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert err.details() == "stage talker (10.0.0.7:50062) unavailable: connection refused"
    info = error_info(err)
    assert (info.reason, info.domain, dict(info.metadata)) == (
        STAGE_UNAVAILABLE, DOMAIN, {"stage": "talker", "replica": "10.0.0.7:50062"})


def test_idle_stream_is_unavailable_with_its_own_reason():
    err = call(StreamIdle("code2wav", 2.5))
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert err.details() == "code2wav: no progress on this stream for 2.5 s"
    assert error_info(err).reason == STREAM_IDLE and error_info(err).metadata["stage"] == "code2wav"


def test_a_stalled_replica_is_named_with_its_address():
    err = call(StreamIdle("code2wav", 3.0, "10.0.0.9:50063"))
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert err.details() == "code2wav (10.0.0.9:50063): no progress on this stream for 3 s"
    assert dict(error_info(err).metadata) == {"stage": "code2wav", "replica": "10.0.0.9:50063"}


def test_each_stage_up_the_chain_waits_longer_so_the_deepest_stall_is_named():
    config = ServingConfig(stream_idle_timeout_s=4.0)
    assert [config.stall_timeout_s(n) for n in (0, 1, 2)] == [4.0, 6.0, 8.0]


def test_overload_is_resource_exhausted_with_retry_info():
    err = call(Overloaded("router at capacity: queue of 4 full", retry_after_s=1.5))
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "router at capacity: queue of 4 full"
    assert retry_after_s(err) == 1.5


def test_engine_failure_and_unknown_errors_are_internal_and_named():
    assert call(EngineFailed("talker", "RuntimeError: boom")).details() == "talker: RuntimeError: boom"
    err = call(KeyError("slot"))
    assert err.code() is grpc.StatusCode.INTERNAL and err.details() == "KeyError: 'slot'"


def test_a_status_chosen_downstream_passes_through_with_its_details():
    downstream = call(StageUnavailable("code2wav", "127.0.0.1:9", "the stream broke"))
    relayed = call(downstream)  # a middle stage ends its own call with the error it received
    assert relayed.code() is grpc.StatusCode.UNAVAILABLE and relayed.details() == downstream.details()
    assert dict(error_info(relayed).metadata) == {"stage": "code2wav", "replica": "127.0.0.1:9"}


def test_failure_of_call_names_the_peer_only_when_nobody_further_down_was_named():
    async def refused() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:  # nothing listens on port 1
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await channel.unary_unary(METHOD)(b"", timeout=5)
            return raised.value

    dead = failure_of_call("talker", "127.0.0.1:1", asyncio.run(refused()))
    assert isinstance(dead, StageUnavailable) and (dead.stage, dead.replica) == ("talker", "127.0.0.1:1")
    further_down = call(StageUnavailable("code2wav", "127.0.0.1:9", "gone"))
    assert failure_of_call("talker", "127.0.0.1:5", further_down) is further_down
    chosen = call(InvalidArgument("voice", "unknown"))
    assert failure_of_call("talker", "127.0.0.1:5", chosen) is chosen
