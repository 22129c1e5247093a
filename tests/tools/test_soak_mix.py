"""The soak's slow reader really reads slowly (services/tools/soak/mix.py): planned with a pause,
it waits that long after every message it reads, so the stages' sends meet flow control.

Pinned bug (project issue 48, item 0): the slow reader never pausing (its pause not planned, or not
applied after each message): the soak's "slow_reader" would be one more normal request, and the
reliability test that runs one against the stack would pass all the same (it checks the outcome
only). Here against an in-process Omni server that streams a fixed reply at once, no stack.
"""

from __future__ import annotations

import random
from concurrent import futures

import grpc

from omni.v1 import omni_pb2
from services.tools.soak.mix import Kind, plan, run_planned

MESSAGES = 4  # 3 text deltas and the final


def replies(request, context):
    for i in range(MESSAGES - 1):
        yield omni_pb2.GenerateResponse(text=omni_pb2.TextDelta(text=f"t{i}", token_ids=[i]))
    yield omni_pb2.GenerateResponse(final=omni_pb2.Final())


def test_the_slow_reader_waits_its_pause_after_every_message():
    planned = plan(random.Random(3), Kind.SLOW_READER, 10.0, chaos=False)
    assert 0.05 <= planned.pause_s <= 0.2, planned.pause_s
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("omni.v1.Omni", {
        "Generate": grpc.unary_stream_rpc_method_handler(
            replies, request_deserializer=omni_pb2.GenerateRequest.FromString,
            response_serializer=omni_pb2.GenerateResponse.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            outcome = run_planned(channel, planned)
    finally:
        server.stop(0)
    assert (outcome.kind, outcome.code, outcome.expected, outcome.hung) == (Kind.SLOW_READER, "OK", True, False), outcome
    # A pause after each of the messages: the whole reply was there at once, the reading took the pauses.
    assert outcome.seconds >= MESSAGES * planned.pause_s, (outcome.seconds, planned.pause_s)
