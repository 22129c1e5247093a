"""Realtime sessions over gRPC (Omni/Session) on the real stack: real speech from the committed
espeak-ng recordings (bench/speech/) through the router's turn detection, responses through every
stage, barge-in, the history a later turn sends, bad input as error events, and the bounds."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
import wave
from array import array
from pathlib import Path

import grpc
import pytest

from omni.v1 import common_pb2, omni_pb2, omni_pb2_grpc
from router.session_audio import wav_bytes
from services.serving.stage_stubs import stage_stub
from services.tools.launcher import free_port

SPEECH = sorted((Path(__file__).parents[2] / "bench" / "speech").glob("*.wav"))
RATE = 16000


def speech(i: int) -> bytes:
    with wave.open(str(SPEECH[i])) as w:
        return w.readframes(w.getnframes())


def silence(seconds: float) -> bytes:
    return bytes(2 * int(RATE * seconds))


class SessionCall:
    """A session from a test: `send` messages, `next_event(kind)` waits for the next of a kind
    (every event is kept in `events`)."""

    def __init__(self, target: str, timeout_s: float = 120):
        self.channel = grpc.insecure_channel(target)
        self.requests: queue.Queue = queue.Queue()
        self.events: list[omni_pb2.SessionEvent] = []
        self.arrived = threading.Condition()
        self.status: grpc.RpcError | None = None
        self.ended = False
        self.call = omni_pb2_grpc.OmniStub(self.channel).Session(iter(self.requests.get, None), timeout=timeout_s)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.seen = 0  # events next_event has handed out or skipped

    def _read(self) -> None:
        try:
            for event in self.call:
                with self.arrived:
                    self.events.append(event)
                    self.arrived.notify_all()
        except grpc.RpcError as err:
            self.status = err
        with self.arrived:
            self.ended = True
            self.arrived.notify_all()

    def send(self, **event) -> None:
        self.requests.put(omni_pb2.SessionRequest(**event))

    def speak(self, pcm: bytes, chunk_ms: int = 100) -> None:
        step = RATE * chunk_ms // 1000 * 2
        for i in range(0, len(pcm), step):
            self.send(append_audio=omni_pb2.AppendAudio(data=pcm[i:i + step]))

    def next_event(self, *kinds: str, timeout_s: float = 60) -> omni_pb2.SessionEvent:
        deadline = time.monotonic() + timeout_s
        with self.arrived:
            while True:
                while self.seen < len(self.events):
                    event = self.events[self.seen]
                    self.seen += 1
                    if event.WhichOneof("event") in kinds:
                        return event
                if self.ended or time.monotonic() > deadline:
                    raise AssertionError(f"no {kinds} event (ended: {self.ended}, status: {self.status}); got "
                                         f"{[e.WhichOneof('event') for e in self.events]}")
                self.arrived.wait(deadline - time.monotonic())

    def response(self, response_id: str) -> tuple[list[int], list[int], omni_pb2.ResponseDone]:
        """(text token ids, codec frame ids, its done event) of a response, once it is done."""
        done = None
        while done is None:
            event = self.next_event("response_done")
            if event.response_id == response_id:
                done = event.response_done
        mine = [e for e in self.events if e.response_id == response_id]
        return ([i for e in mine if e.WhichOneof("event") == "text" for i in e.text.token_ids],
                [i for e in mine if e.WhichOneof("event") == "codec_frames" for i in e.codec_frames.ids], done)

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()
        self.channel.close()


@pytest.fixture
def session(stack):
    calls = []

    def open_session(target: str | None = None, **settings) -> SessionCall:
        call = SessionCall(target or stack.target)
        calls.append(call)
        call.next_event("created")
        if settings:
            call.send(update=omni_pb2.SessionSettings(**settings))
            call.next_event("updated")
        return call

    yield open_session
    for call in calls:
        call.close()


def sampling(tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_new_tokens=tokens)


MANUAL = omni_pb2.TurnDetection(enabled=False)


def one_shot(omni, messages, thinker_tokens: int, talker_frames: int):
    request = omni_pb2.GenerateRequest(messages=messages, return_codec_frames=True,
                                       thinker_sampling=sampling(thinker_tokens), talker_sampling=sampling(talker_frames))
    ids, frames = [], []
    for response in omni.Generate(request, timeout=120):
        kind = response.WhichOneof("event")
        if kind == "text":
            ids += response.text.token_ids
        elif kind == "codec_frames":
            frames += response.codec_frames.ids
    return ids, frames


def test_spoken_turn_is_detected_committed_and_answered_with_text_and_audio(session):
    call = session(thinker_sampling=sampling(6), talker_sampling=sampling(12))
    call.speak(silence(0.5) + speech(0) + silence(1.0))
    started = call.next_event("speech_started").speech_started
    stopped = call.next_event("speech_stopped").speech_stopped
    assert 300 <= started.audio_start_ms <= 800 and stopped.audio_end_ms > started.audio_start_ms + 1000
    committed = call.next_event("committed").committed
    assert committed.item_id == started.item_id == stopped.item_id
    created = call.next_event("response_created")
    ids, _, done = call.response(created.response_id)
    assert done.status == omni_pb2.RESPONSE_STATUS_COMPLETED and ids
    assert done.final.usage.text_tokens == len(ids) and done.audio_ms > 0
    assert any(e.WhichOneof("event") == "audio" and e.response_id == created.response_id for e in call.events)


def test_a_turn_equals_the_one_shot_request_of_its_history_and_a_cancelled_turn_leaves_only_the_played_part(
        session, omni):
    """Greedy: turn 2 and turn 3 of a session give the ids and codec frames of one Generate each whose
    messages are the history (user audio as the wav the session made, replies as their text), turn 2's
    reply cut where the client said it stopped listening."""
    call = session(turn_detection=MANUAL, thinker_sampling=sampling(8), talker_sampling=sampling(40),
                   return_codec_frames=True)
    user1 = speech(0)
    call.speak(user1)
    call.send(commit=omni_pb2.CommitInput())
    call.send(create_response=omni_pb2.CreateResponse())
    first = call.next_event("response_created")
    ids1, frames1, done1 = call.response(first.response_id)
    history = [omni_pb2.Message(role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(audio=wav_bytes(array("h", user1), RATE))])]
    assert (ids1, frames1) == one_shot(omni, history, 8, 40)
    assert done1.transcript

    # Turn 2: a text item, a reply cut at 200 ms (three frames of 80 ms began playing: three tokens).
    call.send(create_item=omni_pb2.CreateItem(message=omni_pb2.Message(
        role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(text="And tomorrow?")])))
    call.next_event("item_added")
    call.send(create_response=omni_pb2.CreateResponse())
    second = call.next_event("response_created")
    ids2, _, done2 = call.response(second.response_id)
    call.send(truncate=omni_pb2.TruncateItem(item_id=second.response_created.item_id, audio_end_ms=200))
    truncated = call.next_event("truncated").truncated
    texts2 = [e.text.text for e in call.events if e.response_id == second.response_id and e.WhichOneof("event") == "text"]
    assert truncated.text == "".join(texts2[:3]) and truncated.audio_end_ms == 200

    call.send(create_item=omni_pb2.CreateItem(message=omni_pb2.Message(
        role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(text="Go on.")])))
    call.next_event("item_added")
    call.send(create_response=omni_pb2.CreateResponse())
    third = call.next_event("response_created")
    ids3, frames3, _ = call.response(third.response_id)
    history += [
        omni_pb2.Message(role=omni_pb2.ROLE_ASSISTANT, content=[omni_pb2.Content(text=done1.transcript)]),
        omni_pb2.Message(role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(text="And tomorrow?")]),
        omni_pb2.Message(role=omni_pb2.ROLE_ASSISTANT, content=[omni_pb2.Content(text=truncated.text)]),
        omni_pb2.Message(role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(text="Go on.")]),
    ]
    assert (ids3, frames3) == one_shot(omni, history, 8, 40)


def loads(stack) -> dict[str, int]:
    held = {}
    for stage in ("thinker", "talker", "code2wav"):
        with grpc.insecure_channel(stack.addresses(stage)[0]) as channel:
            load = stage_stub(stage, channel).GetLoad(common_pb2.LoadRequest(), timeout=5)
        held[stage] = load.queue_depth + load.running + load.in_flight
    return held


def wait_idle(stack, timeout_s: float = 10) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        held = loads(stack)
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def test_speech_over_a_playing_reply_cancels_it_in_every_stage_and_cuts_the_history(session, stack):
    call = session(thinker_sampling=sampling(16), talker_sampling=common_pb2.SamplingParams(
        max_new_tokens=2000, temperature=1.0, seed=3))
    call.speak(speech(1) + silence(0.8))
    created = call.next_event("response_created")
    call.next_event("audio")
    call.speak(speech(2))  # the user talks over the reply
    started = call.next_event("speech_started")
    done = call.next_event("response_done")
    assert done.response_id == created.response_id
    assert done.response_done.status == omni_pb2.RESPONSE_STATUS_CANCELLED
    assert done.response_done.cancel_reason == omni_pb2.CANCEL_REASON_TURN_DETECTED
    truncated = [e.truncated for e in call.events if e.WhichOneof("event") == "truncated"]
    assert truncated and truncated[0].item_id == created.response_created.item_id
    assert done.response_done.transcript == truncated[0].text
    assert call.events.index(done) > call.events.index(started)
    call.send(clear=omni_pb2.ClearInput())
    call.next_event("cleared")
    assert wait_idle(stack) == {"thinker": 0, "talker": 0, "code2wav": 0}


@pytest.mark.parametrize(("message", "code", "field"), [
    (omni_pb2.SessionRequest(), "unknown_event", "event"),
    (omni_pb2.SessionRequest(append_audio=omni_pb2.AppendAudio(data=b"\x01\x02\x03")), "invalid_argument",
     "append_audio.data"),
    (omni_pb2.SessionRequest(update=omni_pb2.SessionSettings(input_format=omni_pb2.AudioFormat(
        encoding=omni_pb2.AUDIO_ENCODING_PCM16, sample_rate=4000))), "invalid_argument", "update.input_format.sample_rate"),
    (omni_pb2.SessionRequest(update=omni_pb2.SessionSettings(output_modalities=[omni_pb2.MODALITY_AUDIO])),
     "invalid_argument", "update.output_modalities"),
    (omni_pb2.SessionRequest(commit=omni_pb2.CommitInput()), "no_input", "commit"),
    (omni_pb2.SessionRequest(cancel_response=omni_pb2.CancelResponse()), "no_response", "cancel_response"),
    (omni_pb2.SessionRequest(truncate=omni_pb2.TruncateItem(item_id="nope")), "unknown_item", "truncate.item_id"),
    (omni_pb2.SessionRequest(create_item=omni_pb2.CreateItem(message=omni_pb2.Message(
        role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(image=b"png")]))), "unsupported",
     "create_item.message.content[0]"),
])
def test_a_bad_message_gets_an_error_event_naming_the_field_and_the_session_goes_on(session, message, code, field):
    call = session(turn_detection=MANUAL, thinker_sampling=sampling(2), output_modalities=[omni_pb2.MODALITY_TEXT])
    message.event_id = "ev-1"
    call.requests.put(message)
    error = call.next_event("error").error
    assert (error.code, error.field, error.event_id) == (code, field, "ev-1")
    call.send(create_item=omni_pb2.CreateItem(message=omni_pb2.Message(
        role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(text="hi")])))
    call.send(create_response=omni_pb2.CreateResponse())
    created = call.next_event("response_created")
    assert call.response(created.response_id)[2].status == omni_pb2.RESPONSE_STATUS_COMPLETED


@pytest.fixture(scope="module")
def tight_router(stack):
    """A second router over the same stages with small session bounds (routers start in a second)."""
    port = free_port()
    routes = []
    for stage in ("thinker", "talker", "code2wav"):
        routes += [f"--{stage}", ",".join(stack.addresses(stage))]
    popen = subprocess.Popen([sys.executable, "-m", "router.server", "--host", "127.0.0.1", "--port", str(port),
                              "--poll-interval-s", "0.5", "--max-in-flight", "1", "--session-idle-timeout-s", "1",
                              "--session-max-turns", "1", "--session-max-input-s", "2", *routes],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    target = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            grpc.channel_ready_future(grpc.insecure_channel(target)).result(timeout=1)
            break
        except grpc.FutureTimeoutError:
            assert time.monotonic() < deadline and popen.poll() is None, "the second router did not start"
    time.sleep(1.5)  # its first health polls
    yield target
    popen.terminate()
    popen.wait(timeout=10)


def test_session_bounds_refuse_at_connect_and_close_with_a_reason(session, tight_router):
    call = session(tight_router, turn_detection=MANUAL, thinker_sampling=sampling(2),
                   output_modalities=[omni_pb2.MODALITY_TEXT])
    # The one place in flight is this session's: a second session is refused before any event.
    other = SessionCall(tight_router)
    with pytest.raises(AssertionError):
        other.next_event("created", timeout_s=10)
    assert other.status is not None and other.status.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    other.close()
    # An input buffer over 2 s is refused; the session goes on.
    call.speak(silence(1.5))
    call.speak(silence(1.0))
    assert call.next_event("error").error.code == "input_buffer_full"
    # One response, then the turn limit closes the session with its reason.
    call.send(commit=omni_pb2.CommitInput())
    call.send(create_response=omni_pb2.CreateResponse())
    created = call.next_event("response_created")
    call.response(created.response_id)
    call.send(create_response=omni_pb2.CreateResponse())
    assert call.next_event("closed").closed.reason == omni_pb2.CLOSE_REASON_TURN_LIMIT
    # The place is free again once the closed session's call ended: a new session opens, and idles out after 1 s.
    deadline = time.monotonic() + 10
    while True:
        idle = SessionCall(tight_router)
        try:
            idle.next_event("created", timeout_s=5)
            break
        except AssertionError:
            idle.close()
            assert time.monotonic() < deadline, "the closed session's place was never given back"
            time.sleep(0.2)
    assert idle.next_event("closed", timeout_s=10).closed.reason == omni_pb2.CLOSE_REASON_IDLE_TIMEOUT
    idle.close()
