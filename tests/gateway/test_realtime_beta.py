"""The beta protocol of the Realtime API (gateway/realtime_beta.py), without processes: a beta client's
events as the GA ones the session takes, and the GA server events as the beta ones, every event
parsed by the pinned openai SDK's beta types (openai/types/beta/realtime/) with no key the beta
type does not have; the errors naming the beta fields."""

from __future__ import annotations

import base64
from typing import get_args

import pytest
from openai.types.beta.realtime.realtime_server_event import RealtimeServerEvent as BetaServerEvent
from pydantic import BaseModel
from test_realtime_translator import CONFIG, MSG, RID, USER, audio, created, done, session, text

from gateway.realtime_beta import GA, Beta, asked
from gateway.realtime_events import ClientEventError, Translator, api_error_event, client_event
from omni.v1 import omni_pb2

# The SDK's beta server event types by their `type`.
BETA_TYPES = {get_args(model.model_fields["type"].annotation)[0]: model for model in get_args(get_args(BetaServerEvent)[0])}


def parsed(event: dict) -> BaseModel:
    """A server event as the SDK's beta type of its name, every key checked (`strict`)."""
    if "session" in event:  # the beta type names OpenAI's models only; the session shows the one served here
        event = {**event, "session": {**event["session"], "model": "gpt-realtime"}}
    model = BETA_TYPES[event["type"]].model_validate({"event_id": "event_x", **event})
    strict(model, event["type"])
    return model


def strict(model: BaseModel, where: str = "") -> None:
    """Every key sent is a field of the SDK's beta type, nested ones too."""
    assert not model.model_extra, (where or type(model).__name__, model.model_extra)
    for name in type(model).model_fields:
        value = getattr(model, name)
        for k, v in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(v, BaseModel):
                strict(v, f"{where}.{name}[{k}]")


def beta_events(dialect: Beta, translator: Translator, *events: omni_pb2.SessionEvent) -> list[dict]:
    out = dialect.outgoing([e for event in events for e in translator.server_events(event)])
    for event in out:
        parsed(event)
    return out


def beta_request(dialect: Beta, translator: Translator, event: dict) -> omni_pb2.SessionRequest:
    """A beta client event as the session's request, as the gateway makes it (realtime.py)."""
    request = client_event(dialect.incoming(event), CONFIG, translator.last_item, translator.tools,
                           translator.sending_format)
    dialect.amend(event, request)
    return request


def test_the_beta_header_asks_for_the_beta_protocol():
    assert asked({"openai-beta": "realtime=v1"}) and asked({"openai-beta": "assistants=v2, realtime=v1"})
    assert not asked({}) and not asked({"openai-beta": "assistants=v2"})


def test_a_beta_session_update_sets_what_its_flat_fields_say_and_turn_detection_null_turns_detection_off():
    translator = Translator(CONFIG, "tiny")
    dialect = Beta(translator)
    request = beta_request(dialect, translator, {"type": "session.update", "session": {
        "modalities": ["audio", "text"], "voice": "alloy", "instructions": "Be brief.", "input_audio_format": "g711_ulaw",
        "output_audio_format": "g711_alaw", "turn_detection": None, "input_audio_transcription": None,
        "max_response_output_tokens": 7, "temperature": 0.7, "tools": [], "tool_choice": "auto"}})
    update = request.update
    assert update.HasField("turn_detection") and not update.turn_detection.enabled
    assert list(update.output_modalities) == [omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO]
    assert update.input_format == omni_pb2.AudioFormat(encoding=omni_pb2.AUDIO_ENCODING_PCM16, sample_rate=8000)
    assert (update.voice, update.instructions) == ("ethan", "Be brief.")
    assert update.thinker_sampling.max_new_tokens == 7 and update.thinker_sampling.temperature == pytest.approx(0.7)
    text_only = beta_request(dialect, translator, {"type": "session.update", "session": {
        "modalities": ["text"], "turn_detection": {"type": "server_vad", "silence_duration_ms": 700}}}).update
    assert list(text_only.output_modalities) == [omni_pb2.MODALITY_TEXT]
    assert text_only.turn_detection.enabled and text_only.turn_detection.silence_duration_ms == 700


def test_the_beta_temperature_and_max_tokens_each_keep_the_other_across_updates():
    translator = Translator(CONFIG, "tiny")
    dialect = Beta(translator)
    settled = session(max_tokens=9)
    settled.updated.settings.thinker_sampling.temperature = 0.6
    beta_events(dialect, translator, settled)
    only_temperature = beta_request(dialect, translator, {"type": "session.update", "session": {"temperature": 0.9}})
    assert only_temperature.update.thinker_sampling.max_new_tokens == 9
    only_tokens = beta_request(dialect, translator, {"type": "session.update", "session": {
        "max_response_output_tokens": 4}}).update.thinker_sampling
    assert only_tokens.max_new_tokens == 4 and only_tokens.temperature == pytest.approx(0.6)
    untouched = beta_request(dialect, translator, {"type": "session.update", "session": {"instructions": "x"}})
    assert not untouched.update.HasField("thinker_sampling")


def test_the_beta_session_and_a_spoken_reply_have_the_beta_names_and_shapes():
    translator = Translator(CONFIG, "tiny")
    dialect = Beta(translator)
    settings = session(vad=True, max_tokens=6)
    settings.updated.settings.voice = "ethan"
    opened = beta_events(dialect, translator, omni_pb2.SessionEvent(created=settings.updated))
    assert [e["type"] for e in opened] == ["session.created", "conversation.created"]
    shown = opened[0]["session"]
    assert (shown["modalities"], shown["input_audio_format"], shown["output_audio_format"]) == (
        ["text", "audio"], "pcm16", "pcm16")
    assert shown["turn_detection"]["type"] == "server_vad" and shown["max_response_output_tokens"] == 6
    beta_events(dialect, translator, omni_pb2.SessionEvent(item_added=omni_pb2.ItemAdded(
        item_id=USER, role=omni_pb2.ROLE_USER, text="Hi")))
    events = beta_events(dialect, translator, created(), text("Hel"), audio(5), text("lo"), done("Hello"))
    assert [e["type"] for e in events] == [
        "response.created", "response.output_item.added", "conversation.item.created", "response.content_part.added",
        "response.audio_transcript.delta", "response.audio.delta", "response.audio_transcript.delta",
        "response.audio.delta", "response.audio.done", "response.audio_transcript.done", "response.content_part.done",
        "response.output_item.done", "response.done"]
    for event in events[3:-2]:
        assert (event["response_id"], event["item_id"], event["output_index"], event["content_index"]) == (RID, MSG, 0, 0)
    assert events[2]["previous_item_id"] == USER and events[9]["transcript"] == "Hello"
    response = events[-1]["response"]
    assert response["modalities"] == ["text", "audio"] and "output_modalities" not in response
    assert response["output"][0]["content"] == [{"type": "audio", "transcript": "Hello"}]


def test_a_text_reply_has_the_beta_text_events():
    translator = Translator(CONFIG, "tiny")
    dialect = Beta(translator)
    beta_events(dialect, translator, session(audio=False))
    events = beta_events(dialect, translator, created(audio=False), text("Hi"), done("Hi"))
    assert [e["type"] for e in events if e["type"].startswith("response.text")] == ["response.text.delta",
                                                                                    "response.text.done"]
    assert events[-1]["response"]["output"][0]["content"] == [{"type": "text", "text": "Hi"}]


def test_a_beta_clients_assistant_text_part_is_the_ga_output_text_and_a_ga_client_sending_it_is_refused_by_name():
    translator = Translator(CONFIG, "tiny")
    item = {"type": "message", "role": "assistant", "content": [{"type": "text", "text": "Earlier."}]}
    made = beta_request(Beta(translator), translator, {"type": "conversation.item.create", "item": item})
    assert made.create_item.message.content[0].text == "Earlier."
    with pytest.raises(ClientEventError) as refused:
        client_event({"type": "conversation.item.create", "item": item}, CONFIG, None)
    assert (refused.value.param, refused.value.code) == ("item.content[0].type", "invalid_value")
    assert "beta" in refused.value.message


@pytest.mark.parametrize(("session_", "param", "code"), [
    ({"turn_detection": {"type": "server_vad", "threshold": -1}}, "session.turn_detection.threshold", "invalid_value"),
    ({"input_audio_format": "pcm24"}, "session.input_audio_format", "unsupported"),
    ({"modalities": ["audio"]}, "session.modalities", "invalid_value"),
    ({"audio": {}}, "session.audio", "unknown_parameter"),  # the GA protocol's, not the beta's
    ({"output_modalities": ["text"]}, "session.output_modalities", "unknown_parameter"),
    ({"max_response_output_tokens": 0}, "session.max_response_output_tokens", "invalid_value"),
    ({"temperature": "hot"}, "session.temperature", "invalid_value"),
    ({"speed": 1.5}, "session.speed", "unsupported"),
])
def test_a_beta_field_refused_is_named_as_the_beta_protocol_names_it(session_, param, code):
    translator = Translator(CONFIG, "tiny")
    dialect = Beta(translator)
    event = {"type": "session.update", "event_id": "ev_1", "session": session_}
    with pytest.raises(ClientEventError) as refused:
        beta_request(dialect, translator, event)
    refused.value.event_id = "ev_1"
    [sent] = dialect.outgoing([api_error_event(refused.value)])
    parsed(sent)
    assert (sent["error"]["param"], sent["error"]["code"], sent["error"]["event_id"]) == (param, code, "ev_1")
    assert "session.audio.input" not in sent["error"]["message"]


def test_the_ga_protocol_passes_events_as_they_are():
    events = [{"type": "conversation.item.done", "item": {"id": "x"}}]
    assert GA().outgoing(events) is events
    assert GA().incoming({"type": "session.update", "session": {"turn_detection": None}}) == {
        "type": "session.update", "session": {"turn_detection": None}}


def test_a_beta_g711_session_reads_mu_law_appends():
    translator = Translator(CONFIG, "tiny")
    dialect = Beta(translator)
    update = {"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}}
    ga = dialect.incoming(update)
    from gateway.realtime_events import requested_formats

    translator.update_requested(requested_formats(ga))
    append = beta_request(dialect, translator, {"type": "input_audio_buffer.append",
                                                "audio": base64.b64encode(b"\x80\xff").decode()})
    assert append.append_audio.data == b"\x7c\x7d\x00\x00"  # 32124, 0 as pcm16: read as mu-law


def test_a_function_call_reply_has_the_beta_shapes():
    from test_realtime_translator import call

    translator = Translator(CONFIG, "tiny")
    dialect = Beta(translator)
    beta_events(dialect, translator, session(audio=False))
    events = beta_events(dialect, translator, created(), call('{"city": "Paris"}'), done(""))
    assert [e["type"] for e in events] == [
        "response.created", "response.output_item.added", "conversation.item.created",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.done"]
    assert events[-1]["response"]["output"][0]["arguments"] == '{"city": "Paris"}'


def test_a_beta_response_create_names_its_overrides_as_the_ga_protocol_does():
    dialect = Beta(Translator(CONFIG, "tiny"))
    ga = dialect.incoming({"type": "response.create", "response": {
        "modalities": ["text"], "max_response_output_tokens": 5, "metadata": {"k": "v"}, "input": [
            {"type": "message", "role": "assistant", "content": [{"type": "text", "text": "Earlier."}]}]}})
    assert ga["response"] == {"output_modalities": ["text"], "max_output_tokens": 5, "metadata": {"k": "v"}, "input": [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Earlier."}]}]}
    # a GA refusal of an override names the beta field
    [sent] = dialect.outgoing([api_error_event(ClientEventError("response.output_modalities is not supported",
                                                                "response.output_modalities", "unsupported"))])
    assert (sent["error"]["param"], sent["error"]["message"]) == ("response.modalities",
                                                                  "response.modalities is not supported")
