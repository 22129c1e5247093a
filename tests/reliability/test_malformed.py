"""A batch of malformed requests: each refused with the status its kind gets, before any output,
and the stack keeps serving with nothing left in flight."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait

import grpc
import pytest

from services.serving.grpc_server import channel_options
from services.tools.soak import Call, malformed_requests, method_for

from .support import MAX_IN_FLIGHT, assert_recovered

CASES = malformed_requests()


@pytest.fixture
def channel(stack):
    with grpc.insecure_channel(stack.target, options=channel_options()) as channel:
        yield channel


def run_batch(channel, requests: dict, timeout: float = 30) -> dict[str, Call]:
    """name -> finished call; MAX_IN_FLIGHT at a time, so admission never refuses one."""
    calls = {name: Call(method_for(channel, request), request, timeout) for name, request in requests.items()}
    with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        _, hanging = wait([pool.submit(call.run) for call in calls.values()], timeout=120)
    assert not hanging
    return calls


def test_malformed_requests_are_refused_before_any_output_and_the_stack_keeps_serving(stack, omni, channel):
    upfront = {name: case for name, case in CASES.items() if case.before_output}
    calls = run_batch(channel, {name: case.request for name, case in upfront.items()})
    for name, call in calls.items():
        case = upfront[name]
        assert call.code == case.code, (name, call.code, call.details)
        assert case.names in call.details, (name, call.details)
        assert call.messages == 0, f"{name}: refused only after {call.messages} response messages"
    assert_recovered(stack, omni)


def test_talker_settings_beyond_the_talker_are_refused_before_any_output(stack, omni, channel):
    # The thinker checks the talker's limits itself, so the client never sees text and then an error.
    talker = {f"{name} #{i}": case for name, case in CASES.items() if "talker" in name for i in range(5)}
    assert talker
    calls = run_batch(channel, {name: case.request for name, case in talker.items()})
    for name, call in calls.items():
        case = talker[name]
        assert call.code == case.code and call.messages == 0, (name, call.code, call.details, call.messages)
        assert case.names in call.details, (name, call.details)
