"""A response's own settings (CreateResponse's overrides) and out-of-band responses, on the real stack:
each response is exactly the one-shot Generate of what it was asked to answer (greedy), and an
out-of-band response leaves the conversation as it was."""

from __future__ import annotations

import numpy as np
import pytest

from omni.v1 import omni_pb2
from sessions.audio import wav_bytes
from sessions.transcription import Transcription
from tests.sessions import procs
from tests.sessions.session_support import MANUAL, RATE, SessionCall, one_shot, sampling, silence, speech


def text(role: int, words: str) -> omni_pb2.Message:
    return omni_pb2.Message(role=role, content=[omni_pb2.Content(text=words)])


def respond(call: SessionCall, **overrides) -> tuple[omni_pb2.ResponseCreated, list[int], omni_pb2.ResponseDone]:
    call.send(create_response=omni_pb2.CreateResponse(**overrides))
    created = call.next_event("response_created")
    ids, _, done = call.response(created.response_id)
    return created.response_created, ids, done


@pytest.mark.exactness
def test_a_responses_overrides_are_its_own_and_an_out_of_band_response_leaves_the_conversation_as_it_was(
        stack, omni):
    call = SessionCall(stack.sessions_target)
    try:
        call.next_event("created")
        call.send(update=omni_pb2.SessionSettings(turn_detection=MANUAL, instructions="Answer briefly.",
                                                   thinker_sampling=sampling(6), talker_sampling=sampling(12)))
        call.next_event("updated")
        call.send(create_item=omni_pb2.CreateItem(item_id="hello", message=text(omni_pb2.ROLE_USER, "Hello!")))
        call.next_event("item_added")

        # Text only, its own instructions and token limit, its metadata echoed.
        created, ids1, done1 = respond(call, instructions="Be terse.", output_modalities=[omni_pb2.MODALITY_TEXT],
                                       max_output_tokens=3, metadata={"topic": "greeting"})
        assert (list(created.output_modalities), created.max_output_tokens, dict(created.metadata)) == (
            [omni_pb2.MODALITY_TEXT], 3, {"topic": "greeting"})
        assert not created.out_of_band and done1.status == omni_pb2.RESPONSE_STATUS_COMPLETED
        assert done1.audio_ms == 0 and not any(e.WhichOneof("event") == "audio" for e in call.events)
        history = [text(omni_pb2.ROLE_SYSTEM, "Be terse."), text(omni_pb2.ROLE_USER, "Hello!")]
        assert ids1 == one_shot(omni, history, 3, 12)[0]

        # Out of band, its own input: a reference to the conversation's item and one inline.
        created, ids2, done2 = respond(call, out_of_band=True, input_set=True, input=[
            omni_pb2.ResponseInput(item_reference="hello"),
            omni_pb2.ResponseInput(message=text(omni_pb2.ROLE_USER, "Summarize that."))])
        assert created.out_of_band and done2.status == omni_pb2.RESPONSE_STATUS_COMPLETED and done2.audio_ms > 0
        oob = [text(omni_pb2.ROLE_SYSTEM, "Answer briefly."), text(omni_pb2.ROLE_USER, "Hello!"),
               text(omni_pb2.ROLE_USER, "Summarize that.")]
        assert ids2 == one_shot(omni, oob, 6, 12)[0]

        # The next response of the conversation: the first reply follows, the out-of-band one does not.
        created, ids3, _ = respond(call)
        assert list(created.output_modalities) == [omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO]
        assert created.max_output_tokens == 6 and not created.metadata
        conversation = [text(omni_pb2.ROLE_SYSTEM, "Answer briefly."), text(omni_pb2.ROLE_USER, "Hello!"),
                        text(omni_pb2.ROLE_ASSISTANT, done1.transcript)]
        assert ids3 == one_shot(omni, conversation, 6, 12)[0]
    finally:
        call.close()


@pytest.mark.exactness
def test_a_committed_turn_is_transcribed_by_a_text_only_pass_equal_to_its_one_shot_request(stack, omni):
    """Manual commit, no response: the transcript's deltas name the committed item, and the
    transcript is exactly the one-shot Generate of the transcription request (greedy)."""
    call = SessionCall(stack.sessions_target)
    try:
        call.next_event("created")
        call.send(update=omni_pb2.SessionSettings(turn_detection=MANUAL, input_transcription=omni_pb2.InputTranscription(
            enabled=True, language="en")))
        assert call.next_event("updated").updated.settings.input_transcription.language == "en"
        pcm = speech(0)
        call.speak(pcm)
        call.send(commit=omni_pb2.CommitInput())
        committed = call.next_event("committed").committed
        completed = call.next_event("transcription_completed", "transcription_failed")
        assert completed.WhichOneof("event") == "transcription_completed"
        completed = completed.transcription_completed
        deltas = [e.transcription_delta for e in call.events if e.WhichOneof("event") == "transcription_delta"]
        assert deltas and {(d.item_id, d.content_index) for d in deltas} == {(committed.item_id, 0)}
        assert (completed.item_id, completed.content_index) == (committed.item_id, 0)
        assert "".join(d.delta for d in deltas) == completed.transcript
        request = Transcription(language="en").request("one-shot", wav_bytes(np.frombuffer(pcm, "<i2"), RATE),
                                                       committed.audio_ms)
        texts = [r.text.text for r in omni.Generate(request, timeout=120) if r.WhichOneof("event") == "text"]
        assert completed.transcript == "".join(t for t in texts if t != "<|im_end|>")
        assert completed.final.usage.text_tokens > 0
    finally:
        call.close()


def test_a_detected_turns_transcript_runs_beside_its_response_after_its_first_audio(stack):
    call = SessionCall(stack.sessions_target)
    try:
        call.next_event("created")
        call.send(update=omni_pb2.SessionSettings(thinker_sampling=sampling(6), talker_sampling=sampling(12),
                                                   input_transcription=omni_pb2.InputTranscription(enabled=True)))
        call.next_event("updated")
        call.speak(silence(0.5) + speech(0) + silence(1.0))
        committed = call.next_event("committed").committed
        created = call.next_event("response_created")
        call.response(created.response_id)
        # The transcript may be done before the response or after it (waited for then).
        done = [e for e in call.events if e.WhichOneof("event") == "transcription_completed"]
        completed = (done[0] if done else call.next_event("transcription_completed")).transcription_completed
        assert completed.item_id == committed.item_id
        kinds = [(e.WhichOneof("event"), e.response_id) for e in call.events]
        first_audio = kinds.index(("audio", created.response_id))
        first_delta = next(i for i, (kind, _) in enumerate(kinds) if kind.startswith("transcription"))
        assert first_audio < first_delta  # the response's first audio went out before the transcript began
    finally:
        call.close()


def test_a_transcription_that_fails_is_transcription_failed_naming_the_item_and_the_session_goes_on():
    """No router to answer (a dead address): the pass fails UNAVAILABLE after its one retry."""
    service = procs.sessions(f"127.0.0.1:{procs.free_port()}")
    call = SessionCall(service.target)
    try:
        call.next_event("created")
        call.send(update=omni_pb2.SessionSettings(turn_detection=MANUAL,
                                                   input_transcription=omni_pb2.InputTranscription(enabled=True)))
        call.next_event("updated")
        call.speak(speech(1))
        call.send(commit=omni_pb2.CommitInput())
        committed = call.next_event("committed").committed
        failed = call.next_event("transcription_failed", "transcription_completed")
        assert failed.WhichOneof("event") == "transcription_failed"
        assert (failed.transcription_failed.item_id, failed.transcription_failed.content_index) == (committed.item_id, 0)
        assert failed.transcription_failed.error.code == "unavailable"
        call.send(clear=omni_pb2.ClearInput())
        call.next_event("cleared")  # the session goes on
        seen = procs.metrics(service.metrics_url)
        assert seen[("omni_session_transcriptions_total", (("status", "failed"),))] == 1
    finally:
        call.close()
        service.stop()
