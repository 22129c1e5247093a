"""The Realtime API events the gateway's translator makes of the sessions service's stream
(gateway/realtime_events.py), without processes: each test feeds it the SessionEvents a session
sends and reads every field a client keys on (type, event_id once sent, response_id, item_id,
output_index, content_index), the order of the events, the done events' final text, transcript
and arguments, the metadata echo and the status. The shapes are checked by the pinned openai SDK's
own parser of server events."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from openai.types.realtime.realtime_server_event import RealtimeServerEvent
from pydantic import TypeAdapter

from gateway import g711
from gateway.config import GatewayConfig
from gateway.realtime_audio import PCM24, AudioFormat, AudioOut
from gateway.realtime_events import ClientEventError, Translator, client_event, requested_formats
from omni.v1 import common_pb2, omni_pb2

CONFIG = GatewayConfig(voices=("ethan",))
RID, MSG, USER, CALL = "resp_1", "item_msg", "item_user", "item_call"
SDK = TypeAdapter(RealtimeServerEvent)


def translate(translator: Translator, *events: omni_pb2.SessionEvent) -> list[dict]:
    """Every server event the translator makes of `events`, each parsed by the SDK as a client would."""
    out = [e for event in events for e in translator.server_events(event)]
    for event in out:
        SDK.validate_python({**event, "event_id": "event_x"})
    return out


def session(audio: bool = True, vad: bool = False, max_tokens: int | None = None) -> omni_pb2.SessionEvent:
    settings = omni_pb2.SessionSettings(
        output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO] if audio else [omni_pb2.MODALITY_TEXT],
        turn_detection=omni_pb2.TurnDetection(enabled=vad, create_response=True, threshold=0.5,
                                              silence_duration_ms=500, prefix_padding_ms=300, interrupt_response=True))
    if max_tokens is not None:
        settings.thinker_sampling.max_new_tokens = max_tokens
    return omni_pb2.SessionEvent(updated=omni_pb2.SessionInfo(session_id="sess_1", settings=settings))


def created(rid: str = RID, item: str = MSG, audio: bool = True, max_tokens: int | None = None,
            **kw) -> omni_pb2.SessionEvent:
    """A response as the session makes it: its settings (the session's and its create's) in the event."""
    body = omni_pb2.ResponseCreated(item_id=item, output_modalities=[omni_pb2.MODALITY_TEXT] + (
        [omni_pb2.MODALITY_AUDIO] if audio else []), **kw)
    if max_tokens is not None:
        body.max_output_tokens = max_tokens
    return omni_pb2.SessionEvent(response_id=rid, response_created=body)


def text(t: str, rid: str = RID) -> omni_pb2.SessionEvent:
    return omni_pb2.SessionEvent(response_id=rid, text=omni_pb2.TextDelta(text=t, token_ids=[1]))


def audio(samples: int, rid: str = RID) -> omni_pb2.SessionEvent:
    pcm = np.full(samples, 0.25, "<f4").tobytes()
    return omni_pb2.SessionEvent(response_id=rid, audio=common_pb2.AudioChunk(pcm=pcm, sample_rate=24000,
                                                                              num_samples=samples))


def call(arguments: str, rid: str = RID, delta: bool = False) -> omni_pb2.SessionEvent:
    """The session's whole call, or (`delta`) a piece of its arguments."""
    body = omni_pb2.FunctionCall(item_id=CALL, call_id="call_1", name="get_weather", arguments=arguments)
    return omni_pb2.SessionEvent(response_id=rid, **{"function_call_delta" if delta else "function_call": body})


def done(transcript: str, status=omni_pb2.RESPONSE_STATUS_COMPLETED, finish=common_pb2.FINISH_REASON_STOP,
         rid: str = RID, **kw) -> omni_pb2.SessionEvent:
    return omni_pb2.SessionEvent(response_id=rid, response_done=omni_pb2.ResponseDone(
        item_id=MSG, status=status, transcript=transcript, final=omni_pb2.Final(text_finish_reason=finish), **kw))


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def test_a_spoken_reply_has_the_whole_lifecycle_in_the_apis_order_every_delta_naming_its_response_item_and_part():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session(), omni_pb2.SessionEvent(item_added=omni_pb2.ItemAdded(
        item_id=USER, role=omni_pb2.ROLE_USER, text="Hi")))
    events = translate(translator, created(), text("Hel"), audio(5), text("lo"), audio(7), done("Hello"))
    assert types(events) == [
        "response.created",
        "response.output_item.added", "conversation.item.added", "response.content_part.added",
        "response.output_audio_transcript.delta", "response.output_audio.delta",
        "response.output_audio_transcript.delta", "response.output_audio.delta",
        "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
        "response.output_item.done", "conversation.item.done", "response.done"]
    ids = {"response_id": RID, "item_id": MSG, "output_index": 0, "content_index": 0}
    for event in events[3:-3]:  # the part's events: added, deltas, done
        assert {k: event[k] for k in ids} == ids, event
    added, item_added = events[1], events[2]
    assert (added["response_id"], added["output_index"], added["item"]["id"]) == (RID, 0, MSG)
    assert added["item"]["status"] == "in_progress" and item_added["item"]["id"] == MSG
    assert events[3]["part"] == {"type": "audio", "transcript": ""}
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    sent = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    assert transcript == "Hello" and len(sent) == 2 * 12  # every sample out, the held bytes at the end
    assert events[9]["transcript"] == "Hello" and events[10]["part"] == {"type": "audio", "transcript": "Hello"}
    item = events[11]["item"]
    assert (events[11]["output_index"], item["id"], item["status"]) == (0, MSG, "completed")
    assert item["content"] == [{"type": "output_audio", "transcript": "Hello"}] and events[12]["item"] == item
    assert item_added["previous_item_id"] == events[12]["previous_item_id"] == USER
    response = events[-1]["response"]
    assert (response["id"], response["status"], response["output"]) == (RID, "completed", [item])
    assert events[0]["response"]["id"] == RID and events[0]["response"]["status"] == "in_progress"


def test_a_text_reply_has_output_text_events_and_its_final_text():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session(audio=False))
    events = translate(translator, created(audio=False), text("Hi"), text(" there"), done("Hi there"))
    assert types(events) == [
        "response.created", "response.output_item.added", "conversation.item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "conversation.item.done", "response.done"]
    assert events[3]["part"] == {"type": "text", "text": ""}
    for event in events[3:8]:  # the part's events: added, deltas, done
        assert (event["response_id"], event["item_id"], event["output_index"], event["content_index"]) == (RID, MSG, 0, 0)
    assert events[6]["text"] == "Hi there" and events[7]["part"] == {"type": "text", "text": "Hi there"}
    assert events[-1]["response"]["output"][0]["content"] == [{"type": "output_text", "text": "Hi there"}]
    assert events[-1]["response"]["output_modalities"] == ["text"]


def test_calls_follow_the_message_at_their_own_output_indexes_with_their_own_lifecycle():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session())
    events = translate(translator, created(), text("Sure."), call('{"city": "Rome"}'), audio(6), done("Sure."))
    calls = [e for e in events if e.get("item_id") == CALL or e.get("item", {}).get("id") == CALL]
    assert types(calls) == ["response.output_item.added", "conversation.item.added",
                            "response.function_call_arguments.delta", "response.function_call_arguments.done",
                            "response.output_item.done", "conversation.item.done"]
    for event in calls:
        assert event.get("output_index", 1) == 1 and event.get("response_id", RID) == RID
    assert calls[3]["arguments"] == '{"city": "Rome"}' and calls[3]["call_id"] == "call_1"
    assert calls[3]["name"] == "get_weather"
    audio_deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert audio_deltas and all((e["item_id"], e["output_index"]) == (MSG, 0) for e in audio_deltas)
    output = events[-1]["response"]["output"]
    assert [(o["type"], o["id"]) for o in output] == [("message", MSG), ("function_call", CALL)]
    assert output[1]["arguments"] == '{"city": "Rome"}' and output[1]["status"] == "completed"


def test_a_streamed_calls_arguments_come_as_their_pieces_then_whole():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session(audio=False))
    events = translate(translator, created(), text("Sure."), call("", delta=True), call('{"city"', delta=True),
                       call(': "Rome"}', delta=True), call('{"city": "Rome"}'), done("Sure."))
    calls = [e for e in events if e.get("item_id") == CALL or e.get("item", {}).get("id") == CALL]
    assert types(calls) == ["response.output_item.added", "conversation.item.added",
                            "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                            "response.function_call_arguments.done", "response.output_item.done",
                            "conversation.item.done"]
    for event in calls[2:5]:
        assert (event["response_id"], event["item_id"], event["output_index"], event["call_id"]) == (RID, CALL, 1, "call_1")
    assert "".join(e["delta"] for e in calls[2:4]) == calls[4]["arguments"] == '{"city": "Rome"}'
    assert calls[0]["item"]["arguments"] == "" and calls[5]["item"]["arguments"] == '{"city": "Rome"}'
    assert events[-1]["response"]["output"][1]["arguments"] == '{"city": "Rome"}'


def test_a_reply_that_is_only_a_call_has_no_message_and_the_call_at_output_index_0():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session())
    events = translate(translator, created(), call("{}"), done(""))
    assert types(events) == ["response.created", "response.output_item.added", "conversation.item.added",
                             "response.function_call_arguments.delta", "response.function_call_arguments.done",
                             "response.output_item.done", "conversation.item.done", "response.done"]
    assert {e["output_index"] for e in events if "output_index" in e} == {0}
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["function_call"]


def test_a_reply_stopped_by_its_token_limit_is_incomplete_and_the_limit_shown():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session(max_tokens=6))
    events = translate(translator, created(max_tokens=6), text("a b c"), done("a b c", finish=common_pb2.FINISH_REASON_LENGTH))
    response = events[-1]["response"]
    assert response["status"] == "incomplete" and response["max_output_tokens"] == 6
    assert response["status_details"] == {"type": "incomplete", "reason": "max_output_tokens", "error": None}
    assert response["output"][0]["status"] == "incomplete"
    assert events[0]["response"]["max_output_tokens"] == 6


def test_a_cancelled_reply_closes_its_message_with_what_the_history_keeps():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session(vad=True))
    events = translate(translator, created(), text("One two"), audio(6),
                       done("One", status=omni_pb2.RESPONSE_STATUS_CANCELLED,
                            cancel_reason=omni_pb2.CANCEL_REASON_TURN_DETECTED))
    assert types(events)[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                                  "response.content_part.done", "response.output_item.done",
                                  "conversation.item.done", "response.done"]
    assert events[-5]["transcript"] == "One"
    response = events[-1]["response"]
    assert (response["status"], response["status_details"]["reason"]) == ("cancelled", "turn_detected")
    assert response["output"][0]["status"] == "incomplete"


def test_a_reply_cancelled_before_any_content_has_no_output():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session())
    events = translate(translator, created(), done("", status=omni_pb2.RESPONSE_STATUS_CANCELLED,
                                                   cancel_reason=omni_pb2.CANCEL_REASON_CLIENT))
    assert types(events) == ["response.created", "response.done"]
    assert events[-1]["response"]["output"] == [] and events[-1]["response"]["status"] == "cancelled"


def test_metadata_is_echoed_on_the_response_the_client_asked_for_not_on_one_turn_detection_started():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session(vad=True))
    detected = translate(translator, created("resp_vad"), done("", rid="resp_vad"))
    assert detected[0]["response"]["metadata"] is None and detected[-1]["response"]["metadata"] is None
    events = translate(translator, created("resp_2", "item_2", metadata={"topic": "second"}), text("Hi", "resp_2"),
                       done("Hi", rid="resp_2"))
    assert events[0]["response"]["metadata"] == events[-1]["response"]["metadata"] == {"topic": "second"}


def test_an_out_of_band_response_has_its_output_and_no_conversation_item():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session(), omni_pb2.SessionEvent(item_added=omni_pb2.ItemAdded(
        item_id=USER, role=omni_pb2.ROLE_USER, text="Hi")))
    events = translate(translator, created(audio=False, out_of_band=True), text("Hi"), call("{}"), done("Hi"))
    assert not [t for t in types(events) if t.startswith("conversation.")]
    response = events[-1]["response"]
    assert response["conversation_id"] is None and [o["id"] for o in response["output"]] == [MSG, CALL]
    assert translator.last_item == USER  # the next item goes after the conversation's last
    with pytest.raises(ClientEventError):
        translator.retrieved({"item_id": MSG})


def test_the_users_transcript_names_its_item_and_part_and_becomes_the_items():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session(), omni_pb2.SessionEvent(committed=omni_pb2.InputCommitted(item_id=USER)))
    ids = {"item_id": USER, "content_index": 0}
    events = translate(translator, *(omni_pb2.SessionEvent(transcription_delta=omni_pb2.TranscriptionDelta(
        **ids, delta=d)) for d in ("Hel", "lo")), omni_pb2.SessionEvent(
        transcription_completed=omni_pb2.TranscriptionCompleted(**ids, transcript="Hello", final=omni_pb2.Final(
            usage=omni_pb2.Usage(prompt_tokens=40, text_tokens=2)))))
    assert [(e["type"], e["item_id"], e["content_index"]) for e in events] == [
        ("conversation.item.input_audio_transcription.delta", USER, 0)] * 2 + [
        ("conversation.item.input_audio_transcription.completed", USER, 0)]
    assert [e["delta"] for e in events[:2]] == ["Hel", "lo"] and events[-1]["transcript"] == "Hello"
    assert events[-1]["usage"] == {"type": "tokens", "input_tokens": 40, "output_tokens": 2, "total_tokens": 42}
    assert translator.retrieved({"item_id": USER})["item"]["content"] == [{"type": "input_audio", "transcript": "Hello"}]
    [failed] = translate(translator, omni_pb2.SessionEvent(transcription_failed=omni_pb2.TranscriptionFailed(
        **ids, error=omni_pb2.SessionError(code="unavailable", message="router gone"))))
    assert (failed["type"], failed["item_id"], failed["error"]["code"]) == (
        "conversation.item.input_audio_transcription.failed", USER, "unavailable")


def test_the_sessions_error_codes_are_openais_where_the_api_has_its_own():
    translator = Translator(CONFIG, "tiny")
    codes = {ours: translate(translator, omni_pb2.SessionEvent(error=omni_pb2.SessionError(
        code=ours, message="m", field="commit", event_id="ev_1")))[0]["error"] for ours in (
        "no_response", "no_input", "invalid_argument", "input_too_fast")}
    assert {k: v["code"] for k, v in codes.items()} == {
        "no_response": "response_cancel_not_active", "no_input": "input_audio_buffer_commit_empty",
        "invalid_argument": "invalid_value", "input_too_fast": "input_too_fast"}
    unknown = {field: translate(translator, omni_pb2.SessionEvent(error=omni_pb2.SessionError(
        code="unknown_item", message="m", field=field)))[0]["error"] for field in (
        "truncate.item_id", "delete_item.item_id", "create_response.input[0].item_reference")}
    assert {field: (e["code"], e["param"]) for field, e in unknown.items()} == {
        "truncate.item_id": ("item_truncate_invalid_item_id", "item_id"),
        "delete_item.item_id": ("item_delete_invalid_item_id", "item_id"),
        "create_response.input[0].item_reference": ("invalid_value", "response.input[0].id")}
    assert codes["no_input"]["event_id"] == "ev_1"


def test_response_create_carries_every_override_to_the_session():
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    create = client_event({"type": "response.create", "response": {
        "instructions": "Be terse.", "output_modalities": ["text"], "max_output_tokens": "inf", "tools": tools,
        "tool_choice": {"type": "function", "name": "get_weather"}, "metadata": {"k": "v"}, "conversation": "none",
        "input": [{"type": "item_reference", "id": USER},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Why?"}]}]}},
        CONFIG, None).create_response
    assert (create.instructions, list(create.output_modalities), create.max_output_tokens) == (
        "Be terse.", [omni_pb2.MODALITY_TEXT], 0)
    assert create.tools_set and [t.name for t in create.tools] == ["get_weather"]
    assert create.tool_choice.function == "get_weather" and dict(create.metadata) == {"k": "v"}
    assert create.out_of_band and create.input_set and create.input[0].item_reference == USER
    assert create.input[1].message.content[0].text == "Why?"
    plain = client_event({"type": "response.create"}, CONFIG, None).create_response
    assert plain == omni_pb2.CreateResponse()  # the session's settings and conversation


@pytest.mark.parametrize(("response", "param"), [
    ({"metadata": {"k": 1}}, "response.metadata"),  # its bounds: the session's (tests/sessions)
    ({"metadata": "text"}, "response.metadata"),
    ({"conversation": "conv_other"}, "response.conversation"),
    ({"audio": {"output": {"voice": "alloy"}}}, "response.audio"),
    ({"no_such_field": 1}, "response.no_such_field"),
    ({"output_modalities": ["audio", "text"]}, "response.output_modalities"),
    ({"max_output_tokens": 0}, "response.max_output_tokens"),
    ({"tool_choice": "required"}, "response.tool_choice"),  # the session has no tools
    ({"input": [{"type": "item_reference"}]}, "response.input[0].id"),
    ({"input": [{"type": "message", "role": "system", "content": [{"type": "input_audio"}]}]},
     "response.input[0].content[0].type"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
     "response.input[0].content[0].image_url"),
])
def test_response_create_refuses_a_wrong_override_by_name(response, param):
    with pytest.raises(ClientEventError) as refused:
        client_event({"type": "response.create", "response": response}, CONFIG, None)
    assert refused.value.param == param


def test_input_transcription_is_taken_with_any_model_name_and_shown_as_the_checkpoints():
    update = client_event({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "transcription": {"model": "gpt-4o-mini-transcribe", "language": "en", "prompt": "weather"}}}}},
        CONFIG, None).update
    assert update.input_transcription == omni_pb2.InputTranscription(enabled=True, language="en", prompt="weather")
    off = client_event({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "transcription": None}}}}, CONFIG, None).update
    assert off.HasField("input_transcription") and not off.input_transcription.enabled
    shown = Translator(CONFIG, "tiny").session(omni_pb2.SessionInfo(session_id="s", settings=omni_pb2.SessionSettings(
        input_transcription=update.input_transcription)))["audio"]["input"]["transcription"]
    assert shown == {"model": "tiny", "language": "en", "prompt": "weather"}
    for bad, param in (({"delay": "low"}, "delay"), ({"language": 1}, "language"), ({"diarize": True}, "diarize")):
        with pytest.raises(ClientEventError) as refused:
            client_event({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
                "transcription": bad}}}}, CONFIG, None)
        assert refused.value.param == f"session.audio.input.transcription.{param}"


@pytest.mark.parametrize(("eagerness", "silence_ms"), [("low", 1000), ("medium", 500), ("auto", 500), ("high", 250),
                                                       (None, 500)])
def test_semantic_vad_is_served_as_the_detectors_settings_its_eagerness_the_silence_that_ends_a_turn(
        eagerness, silence_ms):
    detection = {"type": "semantic_vad", "create_response": False, "interrupt_response": True}
    if eagerness is not None:
        detection["eagerness"] = eagerness
    update = client_event({"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"turn_detection": detection}}}}, CONFIG, None).update
    assert update.turn_detection == omni_pb2.TurnDetection(
        enabled=True, threshold=0.5, prefix_padding_ms=300, silence_duration_ms=silence_ms, create_response=False,
        interrupt_response=True)


@pytest.mark.parametrize(("session", "param"), [
    ({"turn_detection": None}, "session.turn_detection"),  # the beta protocol's: dropped, detection would stay on
    ({"modalities": ["text"]}, "session.modalities"),
    ({"input_audio_format": "pcm16"}, "session.input_audio_format"),
    ({"voice": "alloy"}, "session.voice"),
    ({"temperature": 0.8}, "session.temperature"),
    ({"no_such_field": 1}, "session.no_such_field"),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "threshold": 0.3}}}},
     "session.audio.input.turn_detection.threshold"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "eagerness": "low"}}}},
     "session.audio.input.turn_detection.eagerness"),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}},
     "session.audio.input.turn_detection.eagerness"),
    ({"audio": {"input": {"echo_cancellation": True}}}, "session.audio.input.echo_cancellation"),
    ({"audio": {"output": {"volume": 1}}}, "session.audio.output.volume"),
    ({"audio": {"video": {}}}, "session.audio.video"),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000, "channels": 2}}}},
     "session.audio.input.format.channels"),
    ({"tracing": {"workflow_name": "agent"}}, "session.tracing"),
])
def test_session_update_refuses_every_key_it_does_not_serve_by_name(session, param):
    with pytest.raises(ClientEventError) as refused:
        client_event({"type": "session.update", "session": {"type": "realtime", **session}}, CONFIG, None)
    assert refused.value.param == param


def test_session_update_takes_every_ga_field_it_serves():
    update = client_event({"type": "session.update", "session": {
        "type": "realtime", "model": "gpt-realtime", "instructions": "Be brief.", "output_modalities": ["audio"],
        "max_output_tokens": 64, "tools": [], "tool_choice": "auto", "truncation": "auto", "tracing": "auto",
        "include": None, "prompt": None, "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": 24000}, "transcription": None, "noise_reduction": None,
                      "turn_detection": {"type": "server_vad", "threshold": 0.6, "prefix_padding_ms": 200,
                                         "silence_duration_ms": 700, "create_response": True,
                                         "interrupt_response": False, "idle_timeout_ms": None}},
            "output": {"format": {"type": "audio/pcm"}, "voice": "alloy", "speed": 1.0}}}}, CONFIG, None).update
    assert update.instructions == "Be brief." and update.thinker_sampling.max_new_tokens == 64
    assert (update.turn_detection.silence_duration_ms, update.turn_detection.interrupt_response) == (700, False)


def test_a_created_item_is_echoed_with_its_parts_in_order_and_no_media_bytes():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session())
    parts = [omni_pb2.Content(text="Listen:"), omni_pb2.Content(audio=b""), omni_pb2.Content(image=b""),
             omni_pb2.Content(text="and look.")]
    added, done_ = translate(translator, omni_pb2.SessionEvent(item_added=omni_pb2.ItemAdded(
        item_id=USER, role=omni_pb2.ROLE_USER, text="Listen:and look.", content=parts)))
    assert types([added, done_]) == ["conversation.item.added", "conversation.item.done"]
    assert added["item"]["content"] == [{"type": "input_text", "text": "Listen:"},
                                        {"type": "input_audio", "transcript": None}, {"type": "input_image"},
                                        {"type": "input_text", "text": "and look."}]
    assert translator.retrieved({"item_id": USER})["item"]["content"] == added["item"]["content"]
    (assistant, _) = translate(translator, omni_pb2.SessionEvent(item_added=omni_pb2.ItemAdded(
        item_id=MSG, role=omni_pb2.ROLE_ASSISTANT, text="Hi", content=[omni_pb2.Content(text="Hi")])))
    assert assistant["item"]["content"] == [{"type": "output_text", "text": "Hi"}]


def test_retrieve_answers_with_each_item_as_last_sent_and_names_an_unknown_one():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session())
    translate(translator, omni_pb2.SessionEvent(item_added=omni_pb2.ItemAdded(
        item_id=USER, role=omni_pb2.ROLE_USER, text="Hi")), created(), text("Hello there"), call("{}"),
        done("Hello there"))
    assert translator.retrieved({"item_id": USER})["item"]["content"] == [{"type": "input_text", "text": "Hi"}]
    message = translator.retrieved({"item_id": MSG})
    SDK.validate_python({**message, "event_id": "event_x"})
    assert message["type"] == "conversation.item.retrieved" and message["item"]["status"] == "completed"
    assert message["item"]["content"] == [{"type": "output_audio", "transcript": "Hello there"}]
    assert translator.retrieved({"item_id": CALL})["item"]["arguments"] == "{}"
    translate(translator, omni_pb2.SessionEvent(truncated=omni_pb2.ItemTruncated(item_id=MSG, audio_end_ms=300,
                                                                                 text="Hello")))
    assert translator.retrieved({"item_id": MSG})["item"]["content"][0]["transcript"] == "Hello"
    for bad, code in (({"item_id": "nope"}, "item_retrieve_invalid_item_id"), ({}, "invalid_value")):
        with pytest.raises(ClientEventError) as refused:
            translator.retrieved(bad)
        assert (refused.value.param, refused.value.code) == ("item_id", code)


def test_g711_is_the_reference_companding():
    codes = bytes(range(256))
    ulaw, alaw = (np.frombuffer(g711.decode(codes, law), "<i2") for law in g711.LAWS)
    assert (ulaw[0xFF], ulaw[0x80], ulaw[0x00], alaw[0xD5], alaw[0x55], alaw[0xAA]) == (0, 32124, -32124, 8, -8, 32256)
    for law, table in (("pcmu", ulaw), ("pcma", alaw)):
        assert np.array_equal(np.frombuffer(g711.decode(g711.encode(table, law), law), "<i2"), table)  # exact levels
    audioop = pytest.importorskip("audioop")  # Python's own G.711 (3.11), bit for bit over every int16
    every = np.arange(-32768, 32768).astype("<i2")
    assert g711.encode(every, "pcmu") == audioop.lin2ulaw(every.tobytes(), 2)
    assert g711.encode(every, "pcma") == audioop.lin2alaw(every.tobytes(), 2)
    assert g711.decode(codes, "pcmu") == audioop.ulaw2lin(codes, 2) and g711.decode(codes, "pcma") == audioop.alaw2lin(codes, 2)


@pytest.mark.parametrize("fmt", [AudioFormat("audio/pcm", rate) for rate in (8000, 16000, 22050, 24000, 44100, 48000)]
                         + [AudioFormat("audio/pcmu", 8000), AudioFormat("audio/pcma", 8000)])
def test_a_replys_audio_out_at_any_rate_is_one_stream_whatever_its_chunks_every_sample_in_whole_base64_groups(fmt):
    """One second of a 440 Hz tone at 24 kHz, whole and in 1234-sample chunks: the same bytes, a second
    of them at the asked rate (the resampler's tail flushed at the end), the tone's level kept."""
    tone = 0.5 * np.sin(2 * np.pi * 440 * np.arange(24000) / 24000).astype(np.float32)
    whole_out = AudioOut(fmt)
    whole = whole_out.feed(tone) + whole_out.finish()
    chunked_out = AudioOut(fmt)
    pieces = [chunked_out.feed(tone[i:i + 1234]) for i in range(0, 24000, 1234)]
    assert all(len(p) % (3 * fmt.sample_bytes) == 0 for p in pieces)  # whole base64 groups (and samples) until the end
    assert b"".join(pieces) + chunked_out.finish() == whole
    assert len(whole) == fmt.rate * fmt.sample_bytes
    samples = np.frombuffer(g711.decode(whole, fmt.law) if fmt.law else whole, "<i2")[fmt.rate // 10:] / 32768
    assert 0.48 < np.abs(samples).max() < 0.52
    spectrum = np.abs(np.fft.rfft(samples))
    assert abs(np.argmax(spectrum) * fmt.rate / len(samples) - 440) < 2  # the same tone, at the new rate


def test_g711_output_is_8_khz_bytes_once_the_session_took_the_update_and_input_reads_as_the_last_update_sent():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session())
    update = {"type": "session.update", "session": {"type": "realtime", "audio": {
        "input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {"type": "audio/pcma"}}}}}
    request = client_event(update, CONFIG, None)
    assert request.update.input_format == omni_pb2.AudioFormat(encoding=omni_pb2.AUDIO_ENCODING_PCM16, sample_rate=8000)
    translator.update_requested(requested_formats(update))
    assert translator.sending_format == AudioFormat("audio/pcmu", 8000)  # appends from now on are read as mu-law
    append = client_event({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x80\xff").decode()},
                          CONFIG, None, input_format=translator.sending_format)
    assert np.frombuffer(append.append_audio.data, "<i2").tolist() == [32124, 0]
    [updated] = translate(translator, session())
    assert updated["session"]["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
    events = translate(translator, created(), audio(2400), audio(1201), done("x"))
    deltas = [base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"]
    assert sum(map(len, deltas)) == round((2400 + 1201) / 3)  # a byte per 8 kHz sample of the 24 kHz stream, all out
    assert all(len(d) % 3 == 0 for d in deltas[:-1])  # whole base64 groups until the last
    # refused (the buffer holds audio): the input stays mu-law, as the session reads it
    translator.update_requested((PCM24, None))
    assert translator.sending_format == PCM24
    translate(translator, omni_pb2.SessionEvent(error=omni_pb2.SessionError(
        code="invalid_argument", message="the input buffer holds audio", field="update.input_format")))
    assert translator.sending_format == translator.input_format == AudioFormat("audio/pcmu", 8000)


def test_an_item_deleted_is_said_and_the_next_item_goes_after_the_one_before_it():
    translator = Translator(CONFIG, "tiny")
    for item_id, previous in (("item_a", ""), ("item_b", "item_a")):
        translate(translator, omni_pb2.SessionEvent(item_added=omni_pb2.ItemAdded(
            item_id=item_id, previous_item_id=previous, role=omni_pb2.ROLE_USER, text="hi")))
    assert client_event({"type": "conversation.item.delete", "item_id": "item_b"}, CONFIG, None).delete_item.item_id == \
        "item_b"
    deleted = translate(translator, omni_pb2.SessionEvent(item_deleted=omni_pb2.ItemDeleted(item_id="item_b")))
    assert deleted == [{"type": "conversation.item.deleted", "item_id": "item_b"}]
    assert translator.last_item == "item_a" and "item_b" not in translator.items
    unknown = translate(translator, omni_pb2.SessionEvent(error=omni_pb2.SessionError(
        code="unknown_item", message="m", field="delete_item.item_id")))[0]["error"]
    assert (unknown["code"], unknown["param"]) == ("item_delete_invalid_item_id", "item_id")
    with pytest.raises(ClientEventError) as refused:
        client_event({"type": "conversation.item.delete"}, CONFIG, None)
    assert refused.value.param == "item_id"


@pytest.mark.parametrize(("given", "enabled", "ratio", "shown"), [
    ("auto", True, 0.0, {"type": "retention_ratio", "retention_ratio": 0.8}),
    ("disabled", False, 0.0, "disabled"),
    ({"type": "retention_ratio", "retention_ratio": 0.5}, True, 0.5, {"type": "retention_ratio", "retention_ratio": 0.5}),
])
def test_truncation_is_the_sessions_retention_and_shown_as_it_is(given, enabled, ratio, shown):
    update = client_event({"type": "session.update", "session": {"type": "realtime", "truncation": given}}, CONFIG, None)
    assert (update.update.truncation.enabled, update.update.truncation.retention_ratio) == (enabled, pytest.approx(ratio))
    settings = omni_pb2.SessionSettings(truncation=omni_pb2.Truncation(
        enabled=enabled, retention_ratio=ratio or (0.8 if enabled else 0)))
    shown_now = Translator(CONFIG, "tiny").session(omni_pb2.SessionInfo(session_id="s", settings=settings))["truncation"]
    assert shown_now == shown


@pytest.mark.parametrize(("bad", "param"), [
    ({"type": "retention_ratio", "retention_ratio": 1.5}, "session.truncation.retention_ratio"),
    ({"type": "retention_ratio"}, "session.truncation.retention_ratio"),
    ({"type": "tokens"}, "session.truncation.type"),
    ({"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {}}, "session.truncation.token_limits"),
    ("sometimes", "session.truncation"),
])
def test_a_truncation_we_cannot_serve_is_refused_naming_its_field(bad, param):
    with pytest.raises(ClientEventError) as refused:
        client_event({"type": "session.update", "session": {"type": "realtime", "truncation": bad}}, CONFIG, None)
    assert refused.value.param == param


@pytest.mark.parametrize(("fmt", "param"), [
    ({"type": "audio/pcm", "rate": 4000}, "session.audio.input.format.rate"),
    ({"type": "audio/pcm", "rate": 96000}, "session.audio.input.format.rate"),
    ({"type": "audio/pcm", "rate": "16000"}, "session.audio.input.format.rate"),
    ({"type": "audio/pcmu", "rate": 16000}, "session.audio.input.format.rate"),
    ({"type": "audio/g729"}, "session.audio.input.format.type"),
    ({"type": "audio/pcm", "channels": 2}, "session.audio.input.format.channels"),
])
def test_a_format_or_rate_we_do_not_serve_is_refused_naming_its_field(fmt, param):
    with pytest.raises(ClientEventError) as refused:
        client_event({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"format": fmt}}}},
                     CONFIG, None)
    assert refused.value.param == param and param in refused.value.message


def test_a_declared_pcm16_rate_is_the_sessions_input_rate_and_its_items_wav_rate():
    update = {"type": "session.update", "session": {"type": "realtime", "audio": {
        "input": {"format": {"type": "audio/pcm", "rate": 16000}}, "output": {"format": {"type": "audio/pcm", "rate": 44100}}}}}
    assert client_event(update, CONFIG, None).update.input_format.sample_rate == 16000
    assert requested_formats(update) == (AudioFormat("audio/pcm", 16000), AudioFormat("audio/pcm", 44100))
    item = client_event({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": base64.b64encode(bytes(3200)).decode()}]}}, CONFIG, None,
        input_format=AudioFormat("audio/pcm", 16000))
    wav = item.create_item.message.content[0].audio
    assert wav[:4] == b"RIFF" and int.from_bytes(wav[24:28], "little") == 16000  # the wav's sample rate field


@pytest.mark.parametrize(("part", "param", "code"), [
    ({"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}, "item.content[0].detail",
     "unsupported"),
    ({"type": "input_image", "image_url": "https://example.com/a.png"}, "item.content[0].image_url", "invalid_value"),
    ({"type": "input_image", "image_url": "data:image/gif;base64,AAAA"}, "item.content[0].image_url", "invalid_value"),
    ({"type": "input_image"}, "item.content[0].image_url", "invalid_value"),
    # refused by its length, before it is decoded
    ({"type": "input_image", "image_url": "data:image/png;base64," + "A" * (12 << 20)}, "item.content[0].image_url",
     "invalid_value"),
])
def test_an_input_image_we_cannot_take_is_refused_naming_its_field(part, param, code):
    with pytest.raises(ClientEventError) as refused:
        client_event({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [part]}},
                     CONFIG, None)
    assert (refused.value.param, refused.value.code) == (param, code)


def test_an_input_image_is_the_items_image_part():
    png = b"\x89PNG\r\n\x1a\nrest"
    item = client_event({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(png).decode()},
        {"type": "input_text", "text": "What is it?"}]}}, CONFIG, None)
    assert [p.WhichOneof("part") for p in item.create_item.message.content] == ["image", "text"]
    assert item.create_item.message.content[0].image == png


def test_a_call_cut_by_a_barge_in_is_done_incomplete_with_the_arguments_streamed_so_far():
    translator = Translator(CONFIG, "tiny")
    translate(translator, session(vad=True))
    events = translate(translator, created(), call('{"city"', delta=True),
                       done("", status=omni_pb2.RESPONSE_STATUS_CANCELLED, cancel_reason=omni_pb2.CANCEL_REASON_TURN_DETECTED))
    assert types(events) == ["response.created", "response.output_item.added", "conversation.item.added",
                             "response.function_call_arguments.delta", "response.output_item.done",
                             "conversation.item.done", "response.done"]
    cut = {**events[1]["item"], "status": "incomplete", "arguments": '{"city"'}
    assert events[4]["item"] == events[5]["item"] == cut and events[4]["output_index"] == 0
    assert events[-1]["response"]["output"] == [cut]
    assert translator.items[CALL]["status"] == "incomplete"
