"""What the router passes up of a thinker's stream across a move to another replica, without
processes: a replay's repetition of text and of tool call events is dropped, and a replay whose
call events differ from those passed up ends as diverged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omni.v1 import omni_pb2
from router.stream import RouterStream
from services.serving.status import ReplayDiverged


def stream_of(*events) -> list[omni_pb2.GenerateResponse]:
    out = []
    for event in events:
        if isinstance(event, int):
            out.append(omni_pb2.GenerateResponse(request_id="r", text=omni_pb2.TextDelta(text="", token_ids=[event])))
        elif isinstance(event, omni_pb2.ToolCallDelta):
            out.append(omni_pb2.GenerateResponse(request_id="r", tool_call_delta=event))
        else:
            out.append(omni_pb2.GenerateResponse(request_id="r", tool_call=event))
    return out


DELTA = omni_pb2.ToolCallDelta(index=0, id="call_a", name="f", arguments='{"x"')
DELTA2 = omni_pb2.ToolCallDelta(index=0, id="call_a", name="f", arguments=": 1}")
CALL = omni_pb2.ToolCall(id="call_a", name="f", arguments='{"x": 1}')
REPLY = stream_of(1, 2, DELTA, 3, DELTA2, CALL, 4)


def router_stream() -> RouterStream:
    return RouterStream(SimpleNamespace(metrics=None), omni_pb2.GenerateRequest(), context=None)


def test_a_replays_repeated_text_and_call_events_are_dropped_and_the_rest_passed_up():
    stream = router_stream()
    passed = [stream.pass_up(r) for r in REPLY[:4]]  # the replica dies after token 3
    stream.begin_replay()
    passed += [stream.pass_up(r) for r in REPLY]
    assert [p for p in passed if p is not None] == REPLY
    stream.calls.check_complete()


def test_a_replay_whose_calls_differ_is_diverged():
    stream = router_stream()
    for response in REPLY[:5]:
        stream.pass_up(response)
    stream.begin_replay()
    other = omni_pb2.ToolCallDelta(index=0, id="call_b", name="f", arguments='{"x"')  # another id: not the same call
    with pytest.raises(ReplayDiverged):
        for response in stream_of(1, 2, other, 3, DELTA2):
            stream.pass_up(response)
