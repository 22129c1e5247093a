"""A hosted service's limits on a realtime session, over gRPC on the real stack: the maximum session
length (--session-max-duration-s) and turn detection's `idle_timeout_ms` (a turn of its own when no
speech came after the last reply played)."""

from __future__ import annotations

import urllib.request

import pytest

from omni.v1 import omni_pb2
from services.base.errors import InvalidArgument
from sessions.turn_detection import TurnDetectionSettings
from tests.sessions import procs
from tests.sessions.session_support import SessionCall, sampling, silence


def test_a_session_at_its_maximum_length_is_closed_naming_the_limit(stack):
    limited = procs.sessions(stack.target, "--session-max-duration-s", "2")
    call = SessionCall(limited.target)
    try:
        call.next_event("created")
        call.speak(silence(0.5))  # a client still talking: the limit holds all the same
        closed = call.next_event("closed", timeout_s=30).closed
        assert closed.reason == omni_pb2.CLOSE_REASON_MAX_DURATION
        assert "--session-max-duration-s" in closed.message
        call.reader.join(timeout=30)
        assert call.ended and call.status is None  # the call ended cleanly, after the closing event
        metrics = urllib.request.urlopen(limited.metrics_url, timeout=5).read().decode()
        assert 'omni_session_sessions_total{outcome="max_duration"} 1.0' in metrics
    finally:
        call.close()
        limited.stop()


def test_idle_timeout_is_a_turn_of_its_own_once_the_reply_played(stack):
    """No speech for idle_timeout_ms: timeout_triggered, the silent input committed as its item, a
    response; the clock starts again only once that response ended (and its audio played)."""
    call = SessionCall(stack.sessions_target)
    try:
        call.next_event("created")
        call.send(update=omni_pb2.SessionSettings(
            turn_detection=omni_pb2.TurnDetection(enabled=True, idle_timeout_ms=1000),
            thinker_sampling=sampling(2), talker_sampling=sampling(4)))
        assert call.next_event("updated").updated.settings.turn_detection.idle_timeout_ms == 1000
        call.speak(silence(0.5))  # the microphone's silence: no speech starts
        triggered = call.next_event("timeout_triggered", timeout_s=30).timeout_triggered
        assert triggered.audio_end_ms >= triggered.audio_start_ms
        committed = call.next_event("committed").committed
        assert committed.item_id == triggered.item_id and committed.audio_ms >= 100
        created = call.next_event("response_created")
        assert call.response(created.response_id)[2].status == omni_pb2.RESPONSE_STATUS_COMPLETED
        again = call.next_event("timeout_triggered", timeout_s=30)  # and again, after the reply
        kinds = [e.WhichOneof("event") for e in call.events]
        assert kinds.index("response_done") < call.events.index(again)
    finally:
        call.close()


@pytest.mark.parametrize("ms", [1, 999, 600_001])
def test_an_idle_timeout_outside_its_range_is_refused_naming_the_field(ms):
    with pytest.raises(InvalidArgument) as refused:
        TurnDetectionSettings().updated(omni_pb2.TurnDetection(idle_timeout_ms=ms), "update.turn_detection")
    assert refused.value.field == "update.turn_detection.idle_timeout_ms"
    assert TurnDetectionSettings().updated(omni_pb2.TurnDetection(idle_timeout_ms=0), "x").idle_timeout_ms == 0
