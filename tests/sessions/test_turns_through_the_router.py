"""A session's turns are ordinary Omni/Generate calls from the sessions service to the router: an
idle session holds no place in the router's admission, each turn is one request the router counts,
and a session outlives its router: a turn whose router is gone fails alone, a turn whose first router
target is unavailable is sent to the next, and after a router restart the next turn is answered.

Each test has its own router (one place in flight) over the shared stack's stages and a sessions
service over it (tests/sessions/procs.py), so the router's counters are the test's alone."""

from __future__ import annotations

import grpc
import pytest

from omni.v1 import omni_pb2
from tests.sessions import procs
from tests.sessions.session_support import MANUAL, SessionCall, one_shot, sampling

OK = ("omni_router_requests_total", (("outcome", "ok"),))
TEXT_ONLY = [omni_pb2.MODALITY_TEXT]


@pytest.fixture
def router(stack):
    process = procs.router(stack, "--max-in-flight", "1", "--max-queue", "0")
    yield process
    process.stop()


def open_session(target: str) -> SessionCall:
    call = SessionCall(target)
    call.next_event("created")
    call.send(update=omni_pb2.SessionSettings(turn_detection=MANUAL, thinker_sampling=sampling(3),
                                              output_modalities=TEXT_ONLY))
    call.next_event("updated")
    return call


def ask(call: SessionCall, text: str) -> omni_pb2.ResponseDone:
    """A text turn and its response, once done."""
    call.send(create_item=omni_pb2.CreateItem(message=omni_pb2.Message(
        role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(text=text)])))
    call.send(create_response=omni_pb2.CreateResponse())
    created = call.next_event("response_created")
    return call.response(created.response_id)[2]


def test_idle_sessions_hold_no_router_place_and_each_turn_is_one_generate_through_the_router(router):
    service = procs.sessions(router.target)
    calls = [open_session(service.target) for _ in range(3)]
    try:
        # Three sessions open and idle on a router with one place: the place is free for a request.
        assert procs.metrics(router.metrics_url)[("omni_router_in_flight", ())] == 0
        with grpc.insecure_channel(router.target) as channel:
            from omni.v1 import omni_pb2_grpc

            ids, _ = one_shot(omni_pb2_grpc.OmniStub(channel), [omni_pb2.Message(
                role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(text="Hi")])], 3, 4)
        assert ids
        before = procs.metrics(router.metrics_url)[OK]
        # A turn is one request the router admitted and routed, and gives its place back when done.
        done = ask(calls[0], "Hello")
        assert done.status == omni_pb2.RESPONSE_STATUS_COMPLETED and done.final.usage.text_tokens
        after = procs.metrics(router.metrics_url)
        assert after[OK] == before + 1 and after[("omni_router_in_flight", ())] == 0
        # Each session's turn in turn, on the one place.
        for call in calls[1:]:
            assert ask(call, "Hello").status == omni_pb2.RESPONSE_STATUS_COMPLETED
        seen = procs.metrics(router.metrics_url)
        assert seen[OK] == before + 3 and seen[("omni_router_loop_lag_seconds_count", ())] > 0
    finally:
        for call in calls:
            call.close()
        service.stop()


def test_a_session_outlives_its_router_a_turn_fails_alone_and_after_a_restart_the_next_is_answered(router):
    service = procs.sessions(router.target)
    call = open_session(service.target)
    try:
        assert ask(call, "Hello").status == omni_pb2.RESPONSE_STATUS_COMPLETED
        router.kill()
        failed = ask(call, "Still there?")  # sent, then sent again once: the router is gone
        assert failed.status == omni_pb2.RESPONSE_STATUS_FAILED and failed.error.code == "unavailable"
        assert [e.error.code for e in call.events if e.WhichOneof("event") == "error"] == ["unavailable"]
        assert procs.metrics(service.metrics_url)[("omni_session_turn_retries_total", ())] == 1
        router.start("omni.v1.Omni")  # the same port
        done = ask(call, "And now?")
        assert done.status == omni_pb2.RESPONSE_STATUS_COMPLETED and done.final.usage.text_tokens
        assert call.status is None and not call.ended
    finally:
        call.close()
        service.stop()


def test_a_turn_whose_router_is_unavailable_is_sent_to_the_next_router(router):
    """Two router targets, the first one dead: the turn that goes to it is answered by the second."""
    dead = f"127.0.0.1:{procs.free_port()}"
    service = procs.sessions(f"{dead},{router.target}")
    call = open_session(service.target)
    try:
        for text in ("Hello", "Again"):  # one turn to each target in turn
            assert ask(call, text).status == omni_pb2.RESPONSE_STATUS_COMPLETED
        assert procs.metrics(service.metrics_url)[("omni_session_turn_retries_total", ())] == 1
        assert procs.metrics(router.metrics_url)[OK] == 2
    finally:
        call.close()
        service.stop()
