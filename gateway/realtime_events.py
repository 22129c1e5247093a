"""The OpenAI Realtime API's events <-> the sessions service's Sessions/Session messages, as plain
functions and one small translator that remembers what the events need (each response's item, its modalities,
the settings to show). The shapes are the pinned openai SDK's (openai/types/realtime/).

In: `session.update` (`audio.input.transcription` too: the session transcribes each committed
turn), `input_audio_buffer.append/commit/clear`, `conversation.item.create/truncate/delete`,
`response.create` (with its per-response overrides, out of band and with its own input: the
sessions service checks them against the session) and `response.cancel`, and
`conversation.item.retrieve`, which the translator answers from the items it sent. Everything
else, and every field we cannot honour, is answered with an `error` event naming it
(UNSUPPORTED_EVENTS, the checks below); the session goes on. The audio
formats are gateway/realtime_audio.py's; a beta client's events come here as GA ones
(gateway/realtime_beta.py).

Out: each response's lifecycle in the API's order (Translator). Function calling: the session's
`tools` and `tool_choice` (gateway/tools.py), `function_call` and `function_call_output` items in;
each call of a reply (the thinker parses them: the session's `function_call_delta` and
`function_call` events) as a `function_call` output item (after the reply's message, which is
output_index 0 when it has content), its arguments in `response.function_call_arguments.delta`s as
the model writes them and then `.done`. An out-of-band response's items are not the
conversation's: no `conversation.item.*` events for them. The user's transcript: the
`conversation.item.input_audio_transcription.*` events, the transcript the user item's.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections import deque
from dataclasses import dataclass, field

from gateway import audio as audio_codec
from gateway import realtime_audio
from gateway.config import GatewayConfig
from gateway.convert import DATA_URL
from gateway.errors import APIError
from gateway.realtime_audio import PCM24, AudioFormat, AudioOut, FormatError
from gateway.tools import tool_choice_to_proto, tools_to_proto
from omni.v1 import common_pb2, omni_pb2
from services.base.wav import wav_file

TEXT, AUDIO = omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO
# Client events of the Realtime API this gateway does not serve, and why (docs/sessions.md).
UNSUPPORTED_EVENTS = {
    "output_audio_buffer.clear": "WebRTC only",
    "transcription_session.update": "no transcription sessions",
}
# The sessions service's error codes -> OpenAI's, where the API has its own (clients match on them).
OPENAI_CODES = {
    "no_response": "response_cancel_not_active",
    "no_input": "input_audio_buffer_commit_empty",
    "response_in_progress": "conversation_already_has_active_response",
    "invalid_argument": "invalid_value",
}
# An unknown item's code, by the session message that named it (a response's input reference: invalid_value).
UNKNOWN_ITEM_CODES = {"truncate": "item_truncate_invalid_item_id", "delete_item": "item_delete_invalid_item_id"}
# The beta protocol's content types of an item -> the GA protocol's (gateway/realtime_beta.py translates them).
BETA_PARTS = {"text": "output_text (an assistant's) or input_text", "audio": "output_audio (an assistant's)"}
IMAGE_TYPES = ("image/png", "image/jpeg")
MAX_IMAGE_BYTES = 8 << 20  # an input_image part's, as the sessions service's default bound (--session-max-image-mb)
# Session fields we refuse unless unset/null (the pipeline has no such feature).
REFUSED_SESSION_FIELDS = ("prompt", "reasoning", "include", "parallel_tool_calls")
# The GA protocol's fields of a session and of its parts (the SDK's RealtimeSessionCreateRequest):
# any other key is refused by name (unknown_parameter, as OpenAI does), never dropped.
SESSION_FIELDS = frozenset({"type", "model", "instructions", "output_modalities", "max_output_tokens", "audio", "tools",
                            "tool_choice", "truncation", "tracing", "include", "prompt", "reasoning",
                            "parallel_tool_calls"})
AUDIO_FIELDS = frozenset({"input", "output"})
INPUT_FIELDS = frozenset({"format", "noise_reduction", "transcription", "turn_detection"})
OUTPUT_FIELDS = frozenset({"format", "speed", "voice"})
FORMAT_FIELDS = frozenset({"type", "rate"})
SERVER_VAD_FIELDS = frozenset({"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                               "interrupt_response", "idle_timeout_ms"})
# audio.input.transcription (the SDK's AudioTranscription): model, language and prompt served; the
# others (other models' features) refused unless unset.
TRANSCRIPTION_FIELDS = frozenset({"model", "language", "prompt", "delay", "keywords", "languages"})
# response.create's `response` (the SDK's RealtimeResponseCreateParams): the REFUSED_RESPONSE_FIELDS
# refused unless unset, as a session's.
RESPONSE_FIELDS = frozenset({"audio", "conversation", "input", "instructions", "max_output_tokens", "metadata",
                             "output_modalities", "prompt", "tool_choice", "tools", "parallel_tool_calls", "reasoning"})
REFUSED_RESPONSE_FIELDS = ("audio", "prompt", "parallel_tool_calls", "reasoning")
SEMANTIC_VAD_FIELDS = frozenset({"type", "eagerness", "create_response", "interrupt_response"})
# The beta protocol's flat session fields, and where the GA protocol has each: a beta-era client's
# `turn_detection: null` dropped would leave detection on, so each is refused, naming its GA place.
BETA_SESSION_FIELDS = {
    "modalities": "session.output_modalities", "voice": "session.audio.output.voice",
    "input_audio_format": "session.audio.input.format", "output_audio_format": "session.audio.output.format",
    "turn_detection": "session.audio.input.turn_detection",
    "input_audio_transcription": "session.audio.input.transcription",
    "input_audio_noise_reduction": "session.audio.input.noise_reduction",
    "max_response_output_tokens": "session.max_output_tokens", "speed": "session.audio.output.speed",
    "temperature": None,
}
# semantic_vad's eagerness -> the Silero detector's settings (docs/sessions.md, "Turn detection"):
# no model here judges whether the words are finished, so eagerness sets how long a silence ends
# the turn (low waits longer, high answers sooner); the threshold and padding are the defaults.
EAGERNESS_SILENCE_MS = {"low": 1000, "medium": 500, "auto": 500, "high": 250}
SEMANTIC_VAD_THRESHOLD, SEMANTIC_VAD_PADDING_MS = 0.5, 300
_CHOICES = {omni_pb2.ToolChoice.MODE_NONE: "none", omni_pb2.ToolChoice.MODE_REQUIRED: "required"}
# The session's field names (SessionError.field) -> the Realtime API's.
_PARAMS = (
    ("update.turn_detection", "session.audio.input.turn_detection"),
    ("update.input_format", "session.audio.input.format"),
    ("update.output_modalities", "session.output_modalities"),
    ("append_audio.data", "audio"),
    ("create_item.message", "item"),
    ("create_item.item_id", "item.id"),
    ("truncate.audio_end_ms", "audio_end_ms"),
    ("truncate.item_id", "item_id"),
    ("delete_item.item_id", "item_id"),
    ("update.truncation", "session.truncation"),
    ("update.tools", "session.tools"),
    ("update.input_transcription", "session.audio.input.transcription"),
    ("create_response.max_output_tokens", "response.max_output_tokens"),
    ("create_response.input", "response.input"),
    ("create_response", "response"),
    ("thinker_sampling.max_new_tokens", "session.max_output_tokens"),
    ("voice", "session.audio.output.voice"),
)


class ClientEventError(Exception):
    """A client event we answer with an `error` event."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value",
                 event_id: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.event_id = message, param, code, event_id


def event_id() -> str:
    return f"event_{uuid.uuid4().hex[:20]}"


def error_event(message: str, param: str | None, code: str, client_event_id: str | None = None,
                type_: str = "invalid_request_error") -> dict:
    return {"type": "error", "event_id": event_id(), "error": {
        "type": type_, "code": code, "message": message, "param": param, "event_id": client_event_id}}


def openai_code(error: omni_pb2.SessionError) -> str:
    """A session error's code as OpenAI's: an unknown item's by the event that named it."""
    if error.code == "unknown_item":
        return UNKNOWN_ITEM_CODES.get(error.field.split(".")[0], "invalid_value")
    return OPENAI_CODES.get(error.code, error.code)


def openai_param(field: str) -> str | None:
    if not field:
        return None
    if field.startswith("create_response.input["):  # an input item is the item itself, a reference its id
        field = field.replace(".message", "", 1).replace(".item_reference", ".id", 1)
    for ours, theirs in _PARAMS:
        if field.startswith(ours):
            return theirs + field[len(ours):]
    return field


def decode_base64(value, param: str) -> bytes:
    if not isinstance(value, str):
        raise ClientEventError(f"{param} must be a base64 string", param)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ClientEventError(f"{param} is not valid base64", param) from None


def input_pcm16(data: bytes, fmt: AudioFormat, param: str) -> bytes:
    """Input audio in the session's input format as pcm16 at the format's rate (the session reads it there)."""
    try:
        return fmt.pcm16(data, param)
    except FormatError as exc:
        raise ClientEventError(f"{param}: {exc.message}", param) from None


def pcm16_wav(data: bytes, param: str, fmt: AudioFormat = PCM24) -> bytes:
    """An input_audio part's base64 audio (the input format, mono) as the wav the session takes."""
    return wav_file(input_pcm16(data, fmt, param), fmt.rate)


def _object(value, param: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ClientEventError(f"{param} must be an object", param)
    return value


def _fail(param: str, message: str) -> ClientEventError:
    return ClientEventError(message, param)


def session_update(session: dict, config: GatewayConfig,
                   tools: list[omni_pb2.Tool] | None = None) -> omni_pb2.SessionSettings:
    """`session.update`'s `session` -> SessionSettings; ClientEventError naming what we refuse.
    `tools`: the session's tools before the update (what a tool_choice may name when the update sets none)."""
    session = _object(session, "session")
    settings = omni_pb2.SessionSettings()
    if session.get("type", "realtime") != "realtime":
        raise ClientEventError("only realtime sessions (no transcription sessions)", "session.type", "unsupported")
    for name in session:
        if name in BETA_SESSION_FIELDS:
            ga = BETA_SESSION_FIELDS[name]
            raise ClientEventError(f"session.{name} is a field of the beta protocol (served to a client whose handshake "
                                   "sends OpenAI-Beta: realtime=v1): "
                                   + (f"the GA protocol's is {ga}" if ga else "the GA protocol has none"),
                                   f"session.{name}", "unknown_parameter")
    _known(session, SESSION_FIELDS, "session")
    if not isinstance(session.get("model"), str | None):
        raise ClientEventError("session.model must be a string (the one model served)", "session.model")
    for name in REFUSED_SESSION_FIELDS:
        if session.get(name) not in (None, []):
            raise ClientEventError(f"session.{name} is not supported", f"session.{name}", "unsupported")
    # "auto" (the Agents SDK's default, sent at every connect) asks for the platform's default
    # traces: there are none here, and session.updated says so (tracing null); a configuration of
    # them (workflow name, group, metadata) is refused.
    if session.get("tracing") not in (None, "auto"):
        raise ClientEventError("session.tracing: no traces are kept here (null or 'auto' only)", "session.tracing",
                               "unsupported")
    if "tools" in session:
        settings.tools.extend(tools_to_proto(session["tools"] or [], _fail, "session.tools", flat=True))
        settings.tools_set = True
        tools = list(settings.tools)
    if session.get("tool_choice") is not None:
        settings.tool_choice.CopyFrom(tool_choice_to_proto(session["tool_choice"], tools or [], _fail,
                                                           "session.tool_choice", flat=True))
    if session.get("truncation") is not None:
        settings.truncation.CopyFrom(truncation(session["truncation"]))
    if "instructions" in session:
        if not isinstance(session["instructions"], str | None):
            raise ClientEventError("session.instructions must be a string", "session.instructions")
        settings.instructions = session["instructions"] or ""
    settings.output_modalities.extend(output_modalities(session.get("output_modalities"), "session.output_modalities"))
    if "max_output_tokens" in session:
        tokens = max_output_tokens(session["max_output_tokens"], "session.max_output_tokens")
        if tokens:
            settings.thinker_sampling.max_new_tokens = tokens
        else:
            settings.thinker_sampling.SetInParent()
    audio = _known(_object(session.get("audio"), "session.audio"), AUDIO_FIELDS, "session.audio")
    _input(_object(audio.get("input"), "session.audio.input"), settings)
    output = _known(_object(audio.get("output"), "session.audio.output"), OUTPUT_FIELDS, "session.audio.output")
    audio_format(output.get("format"), "session.audio.output.format")  # the translator's, once the session took the update
    if output.get("speed") not in (None, 1, 1.0):
        raise ClientEventError("session.audio.output.speed must be 1.0 (no time-stretching)", "session.audio.output.speed",
                               "unsupported")
    voice = output.get("voice")
    if isinstance(voice, dict):
        voice = voice.get("id")
    if voice is not None:
        if not isinstance(voice, str):
            raise ClientEventError("session.audio.output.voice must be a string", "session.audio.output.voice")
        try:
            settings.voice = config.voice(voice, "session.audio.output.voice")
        except APIError as exc:
            raise ClientEventError(exc.message, "session.audio.output.voice") from None
    return settings


def output_modalities(modalities, param: str) -> list[int]:
    """`output_modalities` (["audio"]: text and audio; ["text"]) as the session's ([]: unset)."""
    if modalities is None:
        return []
    if modalities not in (["audio"], ["text"]):
        raise ClientEventError(f'{param} must be ["audio"] or ["text"]', param)
    return [TEXT, AUDIO] if modalities == ["audio"] else [TEXT]


def max_output_tokens(tokens, param: str) -> int:
    """`max_output_tokens`: an integer in [1, 4096], or 'inf' (0: the thinker's own limit)."""
    if tokens in (None, "inf"):
        return 0
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 1 <= tokens <= 4096:
        raise ClientEventError(f"{param} must be an integer in [1, 4096] or 'inf'", param)
    return tokens


def input_transcription(value) -> omni_pb2.InputTranscription:
    """`audio.input.transcription`: any `model` (the checkpoint transcribes: there is one model),
    `language` and `prompt` taken into the thinker's transcription instruction; null: off."""
    param = "session.audio.input.transcription"
    if value is None:
        return omni_pb2.InputTranscription(enabled=False)
    value = _known(_object(value, param), TRANSCRIPTION_FIELDS, param)
    for name in ("delay", "keywords", "languages"):
        if value.get(name) is not None:
            raise ClientEventError(f"{param}.{name} is not supported", f"{param}.{name}", "unsupported")
    for name in ("model", "language", "prompt"):
        if not isinstance(value.get(name), str | None):
            raise ClientEventError(f"{param}.{name} must be a string", f"{param}.{name}")
    return omni_pb2.InputTranscription(enabled=True, language=value.get("language") or "",
                                       prompt=value.get("prompt") or "")


def _known(value: dict, fields: frozenset, param: str) -> dict:
    """`value`, once it holds none but `fields`: the first other key refused by name."""
    for name in value:
        if name not in fields:
            raise ClientEventError(f"Unknown parameter: '{param}.{name}'", f"{param}.{name}", "unknown_parameter")
    return value


def _input(audio_in: dict, settings: omni_pb2.SessionSettings) -> None:
    _known(audio_in, INPUT_FIELDS, "session.audio.input")
    input_format = audio_format(audio_in.get("format"), "session.audio.input.format")
    if input_format is not None:  # the session reads pcm16 at the format's rate (the gateway decodes G.711)
        settings.input_format.CopyFrom(omni_pb2.AudioFormat(encoding=omni_pb2.AUDIO_ENCODING_PCM16,
                                                            sample_rate=input_format.rate))
    if "transcription" in audio_in:
        settings.input_transcription.CopyFrom(input_transcription(audio_in["transcription"]))
    if audio_in.get("noise_reduction") is not None:
        raise ClientEventError("session.audio.input.noise_reduction is not supported",
                               "session.audio.input.noise_reduction", "unsupported")
    if "turn_detection" not in audio_in:
        return
    detection = audio_in["turn_detection"]
    if detection is None:
        settings.turn_detection.enabled = False
        return
    param = "session.audio.input.turn_detection"
    detection = _object(detection, param)
    kind = detection.get("type", "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        raise ClientEventError("turn_detection.type must be server_vad or semantic_vad", f"{param}.type")
    _known(detection, SERVER_VAD_FIELDS if kind == "server_vad" else SEMANTIC_VAD_FIELDS, param)
    turn = settings.turn_detection
    if "idle_timeout_ms" in detection:  # server_vad's alone (semantic_vad has none: refused above); null = off
        idle = detection["idle_timeout_ms"]
        if idle is not None and (not isinstance(idle, int) or isinstance(idle, bool) or idle < 0):
            raise ClientEventError("idle_timeout_ms must be an integer >= 0 or null", f"{param}.idle_timeout_ms")
        turn.idle_timeout_ms = idle or 0
    turn.enabled = True
    if kind == "semantic_vad":
        _semantic_vad(detection.get("eagerness"), turn, f"{param}.eagerness")
    for name, cast in (("threshold", float), ("prefix_padding_ms", int), ("silence_duration_ms", int),
                       ("create_response", bool), ("interrupt_response", bool)):
        value = detection.get(name)
        if value is None:
            continue
        if cast is bool:
            ok, need = isinstance(value, bool), "a bool"
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 and (
                cast is float or float(value).is_integer())
            need = "a number >= 0" if cast is float else "an integer >= 0"
        if not ok:
            raise ClientEventError(f"{name} must be {need}", f"{param}.{name}")
        setattr(turn, name, cast(value))


def _semantic_vad(eagerness, turn: omni_pb2.TurnDetection, param: str) -> None:
    """semantic_vad as the detector's settings (EAGERNESS_SILENCE_MS); unset eagerness is auto."""
    if eagerness is None:
        eagerness = "auto"
    if eagerness not in EAGERNESS_SILENCE_MS:
        raise ClientEventError("eagerness must be low, medium, high or auto", param)
    turn.silence_duration_ms = EAGERNESS_SILENCE_MS[eagerness]
    turn.threshold, turn.prefix_padding_ms = SEMANTIC_VAD_THRESHOLD, SEMANTIC_VAD_PADDING_MS


def truncation(value) -> omni_pb2.Truncation:
    """`session.truncation`: "auto" (the oldest turns dropped to 0.8 of them when a turn does not fit),
    "disabled", or a retention_ratio object; ClientEventError naming the field."""
    if value in ("auto", "disabled"):
        return omni_pb2.Truncation(enabled=value == "auto")
    value = _known(_object(value, "session.truncation"), frozenset({"type", "retention_ratio"}), "session.truncation")
    if value.get("type") != "retention_ratio":
        raise ClientEventError("session.truncation must be 'auto', 'disabled' or {type: 'retention_ratio', ...}",
                               "session.truncation.type")
    ratio = value.get("retention_ratio")
    if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 < ratio < 1:
        raise ClientEventError("retention_ratio must be a number above 0 and below 1",
                               "session.truncation.retention_ratio")
    return omni_pb2.Truncation(enabled=True, retention_ratio=ratio)


def truncation_of(settings: omni_pb2.SessionSettings):
    """The session's truncation as the API shows it."""
    cut = settings.truncation
    if not cut.enabled:
        return "disabled"
    return {"type": "retention_ratio", "retention_ratio": round(cut.retention_ratio, 4)}


def audio_format(fmt, param: str) -> AudioFormat | None:
    """A format object (None: unset) as the format (gateway/realtime_audio.py); ClientEventError naming its field."""
    if fmt is None:
        return None
    try:
        return realtime_audio.parse(_known(_object(fmt, param), FORMAT_FIELDS, param))
    except FormatError as exc:
        raise ClientEventError(f"{param}.{exc.param}: {exc.message}", f"{param}.{exc.param}", exc.code) from None


def requested_formats(event: dict) -> tuple[AudioFormat | None, AudioFormat | None]:
    """A `session.update` (checked by session_update)'s input and output formats; None: unchanged."""
    audio = _object(_object(event.get("session"), "session").get("audio"), "session.audio")
    return tuple(audio_format(_object(audio.get(side), f"session.audio.{side}").get("format"),
                              f"session.audio.{side}.format") for side in ("input", "output"))


def create_item(event: dict, last_item: str | None, input_format: AudioFormat = PCM24) -> omni_pb2.CreateItem:
    """`conversation.item.create` -> CreateItem (messages of text, and a user's input_audio and input_image)."""
    if event.get("previous_item_id") not in (None, "root", last_item):
        raise ClientEventError("items go after the last item only", "previous_item_id", "unsupported")
    item = _object(event.get("item"), "item")
    create = omni_pb2.CreateItem(message=item_message(item, "item", input_format))
    if isinstance(item.get("id"), str) and item["id"]:
        create.item_id = item["id"]
    return create


def item_message(item: dict, param: str, input_format: AudioFormat = PCM24) -> omni_pb2.Message:
    """An item the client gives (`param`: where) as a Message: messages of text and a user's
    input_audio and input_image, function_call and function_call_output items."""
    if item.get("type") in ("function_call", "function_call_output"):
        return _function_item(item, param)
    if item.get("type") != "message":
        raise ClientEventError(f"{param}.type {item.get('type')!r} is not supported (message, function_call and "
                               "function_call_output items)", f"{param}.type", "unsupported")
    roles = {"user": omni_pb2.ROLE_USER, "system": omni_pb2.ROLE_SYSTEM, "assistant": omni_pb2.ROLE_ASSISTANT}
    if item.get("role") not in roles:
        raise ClientEventError(f"{param}.role must be user, system or assistant", f"{param}.role")
    message = omni_pb2.Message(role=roles[item["role"]])
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise ClientEventError(f"{param}.content must be a non-empty list", f"{param}.content")
    for i, part in enumerate(content):
        at = f"{param}.content[{i}]"
        part = _object(part, at)
        kind = part.get("type")
        if kind in BETA_PARTS:
            raise ClientEventError(f"{at}.type {kind!r} is the beta protocol's: the GA protocol's is "
                                   f"{BETA_PARTS[kind]}", f"{at}.type", "invalid_value")
        if kind in ("input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise ClientEventError(f"{at}.text must be a string", f"{at}.text")
            message.content.add(text=part["text"])
        elif kind == "output_audio" and isinstance(part.get("transcript"), str):
            message.content.add(text=part["transcript"])  # what the history keeps of an assistant's audio
        elif kind == "input_audio" and item["role"] == "user":
            pcm = decode_base64(part.get("audio"), f"{at}.audio")
            message.content.add(audio=pcm16_wav(pcm, f"{at}.audio", input_format))
        elif kind == "input_image" and item["role"] == "user":
            message.content.add(image=input_image(part, at))
        else:
            raise ClientEventError(f"{at}.type {kind!r} is not supported here", f"{at}.type", "unsupported")
    return message


def input_image(part: dict, param: str) -> bytes:
    """An `input_image` part's png or jpeg, from its base64 data URL, refused by size before it is
    decoded (the sessions service checks the file and its pixels: sessions/images.py)."""
    if part.get("detail") not in (None, "auto", "high"):
        raise ClientEventError(f"{param}.detail: the model sees an image at its own resolution (auto or high)",
                               f"{param}.detail", "unsupported")
    url = part.get("image_url")
    match = DATA_URL.match(url) if isinstance(url, str) else None
    if match is None or match["mime"] not in IMAGE_TYPES:
        raise ClientEventError(f"{param}.image_url must be a data URL of a png or jpeg (data:image/png;base64,...): the "
                               "gateway fetches nothing", f"{param}.image_url")
    if len(match["data"]) * 3 // 4 > MAX_IMAGE_BYTES:
        raise ClientEventError(f"{param}.image_url: the image is over {MAX_IMAGE_BYTES >> 20} MiB", f"{param}.image_url")
    return decode_base64(match["data"], f"{param}.image_url")


def _function_item(item: dict, param: str) -> omni_pb2.Message:
    """A `function_call` item (an assistant's call) or `function_call_output` (a tool's result)."""
    for name in ("call_id", "name", "arguments") if item["type"] == "function_call" else ("call_id", "output"):
        if not isinstance(item.get(name), str) or (name != "output" and name != "arguments" and not item[name]):
            raise ClientEventError(f"{param}.{name} is required (a string)", f"{param}.{name}")
    if item["type"] == "function_call":
        return omni_pb2.Message(role=omni_pb2.ROLE_ASSISTANT, tool_calls=[omni_pb2.ToolCall(
            id=item["call_id"], name=item["name"], arguments=item["arguments"])])
    return omni_pb2.Message(role=omni_pb2.ROLE_TOOL, tool_call_id=item["call_id"],
                            content=[omni_pb2.Content(text=item["output"])])


def response_create(event: dict, tools: list[omni_pb2.Tool] | None = None,
                    input_format: AudioFormat = PCM24) -> omni_pb2.CreateResponse:
    """`response.create` -> CreateResponse: the session's settings, and each override the
    `response` sets (the sessions service checks them against the session); `conversation: "none"`
    an out-of-band response; `input` its own prompt (items, or `item_reference`s). `tools`: the
    session's (what a tool_choice may name when the response sets none)."""
    response = _known(_object(event.get("response"), "response"), RESPONSE_FIELDS, "response")
    create = omni_pb2.CreateResponse()
    for name in REFUSED_RESPONSE_FIELDS:
        if response.get(name) is not None:
            raise ClientEventError(f"response.{name} is not supported", f"response.{name}", "unsupported")
    if response.get("instructions") is not None:
        if not isinstance(response["instructions"], str):
            raise ClientEventError("response.instructions must be a string", "response.instructions")
        create.instructions = response["instructions"]
    create.output_modalities.extend(output_modalities(response.get("output_modalities"), "response.output_modalities"))
    if response.get("max_output_tokens") is not None:
        create.max_output_tokens = max_output_tokens(response["max_output_tokens"], "response.max_output_tokens")
    if response.get("tools") is not None:
        create.tools.extend(tools_to_proto(response["tools"], _fail, "response.tools", flat=True))
        create.tools_set, tools = True, list(create.tools)
    if response.get("tool_choice") is not None:
        create.tool_choice.CopyFrom(tool_choice_to_proto(response["tool_choice"], tools or [], _fail,
                                                         "response.tool_choice", flat=True))
    metadata = response.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in metadata.items()):
            raise ClientEventError("response.metadata must be an object of string values", "response.metadata")
        create.metadata.update(metadata)  # its bounds: the sessions service's
    conversation = response.get("conversation", "auto")
    if conversation not in (None, "auto", "none"):
        raise ClientEventError("response.conversation must be 'auto' or 'none' (the session has one conversation)",
                               "response.conversation", "unsupported")
    create.out_of_band = conversation == "none"
    if response.get("input") is not None:
        if not isinstance(response["input"], list):
            raise ClientEventError("response.input must be a list of items", "response.input")
        create.input_set = True
        for i, item in enumerate(response["input"]):
            item = _object(item, f"response.input[{i}]")
            if item.get("type") == "item_reference":
                if not isinstance(item.get("id"), str):
                    raise ClientEventError("an item_reference names an item by its id", f"response.input[{i}].id")
                create.input.add(item_reference=item["id"])
            else:
                create.input.add(message=item_message(item, f"response.input[{i}]", input_format))
    return create


def client_event(event: dict, config: GatewayConfig, last_item: str | None,
                 tools: list[omni_pb2.Tool] | None = None, input_format: AudioFormat = PCM24) -> omni_pb2.SessionRequest:
    """One client event as a SessionRequest; ClientEventError for what we refuse.
    `tools`: the session's tools as its last settings showed them; `input_format`: the client's
    input audio's, which the session gets as pcm16 at its rate."""
    kind = event.get("type")
    request = omni_pb2.SessionRequest()
    if isinstance(event.get("event_id"), str):
        request.event_id = event["event_id"]
    match kind:
        case "session.update":
            request.update.CopyFrom(session_update(event.get("session"), config, tools))
        case "input_audio_buffer.append":
            request.append_audio.data = input_pcm16(decode_base64(event.get("audio"), "audio"), input_format, "audio")
        case "input_audio_buffer.commit":
            request.commit.SetInParent()
        case "input_audio_buffer.clear":
            request.clear.SetInParent()
        case "conversation.item.create":
            request.create_item.CopyFrom(create_item(event, last_item, input_format))
        case "conversation.item.delete":
            if not isinstance(event.get("item_id"), str):
                raise ClientEventError("item_id must be a string", "item_id")
            request.delete_item.item_id = event["item_id"]
        case "conversation.item.truncate":
            if not isinstance(event.get("item_id"), str):
                raise ClientEventError("item_id must be a string", "item_id")
            end = event.get("audio_end_ms")
            if not isinstance(end, int) or isinstance(end, bool) or end < 0:
                raise ClientEventError("audio_end_ms must be an integer >= 0", "audio_end_ms")
            if event.get("content_index", 0) != 0:
                raise ClientEventError("an assistant item has one content part: content_index 0", "content_index")
            request.truncate.item_id, request.truncate.audio_end_ms = event["item_id"], end
        case "response.create":
            request.create_response.CopyFrom(response_create(event, tools, input_format))
        case "response.cancel":
            request.cancel_response.SetInParent()
        case str() if kind in UNSUPPORTED_EVENTS:
            raise ClientEventError(f"{kind} is not supported: {UNSUPPORTED_EVENTS[kind]}", "type", "unsupported")
        case _:
            raise ClientEventError(f"unknown event type {kind!r}", "type", "unknown_event")
    return request


@dataclass
class OpenCall:
    """A call the reply is making: its output_index, the item before it, its item as added and its
    arguments so far (what a response that ends before the call's done shows, incomplete)."""

    index: int
    previous: str | None
    item: dict
    arguments: str = ""


@dataclass
class Output:
    """A response as the client has been told of it: its assistant message (opened at its first
    content, so a reply that is only a call has no message) and its calls, each at the output
    index it was given in the order they went out."""

    item_id: str  # the assistant message's id (ResponseCreated.item_id)
    audio: bool  # audio out: the message's part is audio with a transcript, else text
    metadata: dict | None  # the client's response.create metadata, echoed in response.created and .done
    max_output_tokens: int | str
    # The audio out in the session's output format when the response began (its bytes in whole base64 groups)
    encoder: AudioOut = field(default_factory=AudioOut)
    index: int | None = None  # the message's output_index once its first content went out
    previous: str | None = None  # the item before the message, once it went out
    next_index: int = 0
    out_of_band: bool = False  # conversation "none": its items are not the conversation's (no conversation.item.*)
    calls: list[tuple[int, dict]] = field(default_factory=list)  # (output_index, the done function_call item)
    open_calls: dict[str, OpenCall] = field(default_factory=dict)  # a call's item -> its state, until its done


class Translator:
    """The session's events -> the Realtime API's server events, in the order the API documents:
    per response `response.created`; the message's `response.output_item.added`,
    `conversation.item.added` and `response.content_part.added` before its first delta; each call's
    item added, arguments and item done; the message's `*.done` events with its final transcript
    or text, `response.content_part.done`, `response.output_item.done` and `conversation.item.done`;
    then `response.done`."""

    def __init__(self, config: GatewayConfig, model: str):
        self.config = config
        self.model = model
        self.last_item: str | None = None  # the conversation's last item id
        self.responses: dict[str, Output] = {}  # response_id -> the response in progress
        self.audio_out = True  # the session's output modalities hold audio (from its created/updated events)
        self.max_output_tokens: int | str = "inf"  # the session's (from its created/updated events)
        self.tools: list[omni_pb2.Tool] = []  # the session's tools (from its created/updated events)
        self.sampling = common_pb2.SamplingParams()  # the session's thinker sampling (the same)
        # item_id -> the item as the client was last told of it, which answers conversation.item.retrieve
        # here (the session holds the same items, so this grows no more than the session does)
        self.items: dict[str, dict] = {}
        # The client's audio formats (realtime_audio.AudioFormat): the session's output format is the
        # gateway's alone; the input's as the session reads it now (`input_format`) and as the
        # appends sent since are read (`sending_format`: the last update sent, until refused).
        # Each update sent queues its formats; the session answers each in order, updated or an
        # error about `update`.
        self.input_format = self.output_format = self.sending_format = PCM24
        self.updates: deque[tuple[AudioFormat | None, AudioFormat | None]] = deque()

    def update_requested(self, formats: tuple[AudioFormat | None, AudioFormat | None]) -> None:
        """A client's session.update about to be sent: its input and output formats (None: unchanged)."""
        self.updates.append(formats)
        self.sending_format = formats[0] or self.sending_format

    def update_answered(self, taken: bool) -> None:
        """The session took (updated) or refused (an error about `update`) the oldest update sent."""
        if not self.updates:
            return  # the gateway's own update at the start
        input_format, output_format = self.updates.popleft()
        if taken:
            self.input_format = input_format or self.input_format
            self.output_format = output_format or self.output_format
        self.sending_format = next((f for f, _ in reversed(self.updates) if f), self.input_format)

    def session(self, info: omni_pb2.SessionInfo) -> dict:
        s = info.settings
        turn = s.turn_detection
        detection = None if not turn.enabled else {
            "type": "server_vad", "threshold": round(turn.threshold, 4), "prefix_padding_ms": turn.prefix_padding_ms,
            "silence_duration_ms": turn.silence_duration_ms, "create_response": turn.create_response,
            "interrupt_response": turn.interrupt_response, "idle_timeout_ms": turn.idle_timeout_ms or None}
        return {
            "type": "realtime", "object": "realtime.session", "id": info.session_id, "model": self.model,
            "instructions": s.instructions, "output_modalities": ["audio"] if AUDIO in s.output_modalities else ["text"],
            "max_output_tokens": s.thinker_sampling.max_new_tokens if s.thinker_sampling.HasField("max_new_tokens")
            else "inf",
            "audio": {"input": {"format": self.input_format.shown(), "turn_detection": detection,
                                "transcription": {"model": self.model, "language": s.input_transcription.language or None,
                                                  "prompt": s.input_transcription.prompt or None}
                                if s.input_transcription.enabled else None, "noise_reduction": None},
                      "output": {"format": self.output_format.shown(), "voice": s.voice or self.config.default_voice,
                                 "speed": 1.0}},
            "tools": [{"type": "function", "name": t.name, "description": t.description,
                       "parameters": json.loads(t.parameters) if t.parameters else {}} for t in s.tools],
            "tool_choice": _CHOICES.get(s.tool_choice.mode, "auto") if s.tool_choice.mode != s.tool_choice.MODE_FUNCTION
            else {"type": "function", "name": s.tool_choice.function},
            "tracing": None, "truncation": truncation_of(s),
        }

    def server_events(self, event: omni_pb2.SessionEvent) -> list[dict]:
        kind = event.WhichOneof("event")
        body = getattr(event, kind)
        rid = event.response_id
        match kind:
            case "created" | "updated":
                if kind == "updated":
                    self.update_answered(True)
                self.settings(body.settings)
                return [{"type": f"session.{kind}", "session": self.session(body)}]
            case "speech_started":
                return [{"type": "input_audio_buffer.speech_started", "audio_start_ms": body.audio_start_ms,
                         "item_id": body.item_id}]
            case "timeout_triggered":  # then its committed and (the session's) response, as a detected stop's
                return [{"type": "input_audio_buffer.timeout_triggered", "audio_start_ms": body.audio_start_ms,
                         "audio_end_ms": body.audio_end_ms, "item_id": body.item_id}]
            case "speech_stopped":
                return [{"type": "input_audio_buffer.speech_stopped", "audio_end_ms": body.audio_end_ms,
                         "item_id": body.item_id}]
            case "committed":
                item = {"id": body.item_id, "object": "realtime.item", "type": "message", "role": "user",
                        "status": "completed", "content": [{"type": "input_audio", "transcript": None}]}
                return [{"type": "input_audio_buffer.committed", "item_id": body.item_id,
                         "previous_item_id": body.previous_item_id or None}, *self.item_events(item, body.previous_item_id)]
            case "cleared":
                return [{"type": "input_audio_buffer.cleared"}]
            case "item_added" if body.role == omni_pb2.ROLE_TOOL:
                item = {"id": body.item_id, "object": "realtime.item", "type": "function_call_output",
                        "status": "completed", "call_id": body.tool_call_id, "output": body.text}
                return self.item_events(item, body.previous_item_id)
            case "item_added" if body.tool_calls:
                events = []
                for k, call in enumerate(body.tool_calls):  # the item's id for its first call
                    item = {"id": body.item_id if k == 0 else f"{body.item_id}_{k}", "object": "realtime.item",
                            "type": "function_call", "status": "completed", "call_id": call.id, "name": call.name,
                            "arguments": call.arguments}
                    events += self.item_events(item, body.previous_item_id if k == 0 else self.last_item)
                return events
            case "function_call_delta" | "function_call":
                return self.function_call(rid, body, done=kind == "function_call")
            case "item_added":
                role = omni_pb2.Role.Name(body.role).removeprefix("ROLE_").lower()
                item = {"id": body.item_id, "object": "realtime.item", "type": "message", "role": role,
                        "status": "completed", "content": item_content(role, body)}
                return self.item_events(item, body.previous_item_id)
            case "response_created":
                return self.response_created(rid, body)
            case "text":
                return self.text_delta(rid, body)
            case "audio":
                return self.audio_delta(rid, body)
            case "response_done":
                return self.response_done(rid, body)
            case "item_deleted":
                self.items.pop(body.item_id, None)
                if self.last_item == body.item_id:  # the next item goes after the one before it
                    self.last_item = next(reversed(self.items), None)
                return [{"type": "conversation.item.deleted", "item_id": body.item_id}]
            case "transcription_delta":
                return [{"type": "conversation.item.input_audio_transcription.delta", "item_id": body.item_id,
                         "content_index": body.content_index, "delta": body.delta}]
            case "transcription_completed":
                self.transcribed(body.item_id, body.content_index, body.transcript)
                usage = body.final.usage
                return [{"type": "conversation.item.input_audio_transcription.completed", "item_id": body.item_id,
                         "content_index": body.content_index, "transcript": body.transcript, "usage": {
                             "type": "tokens", "input_tokens": usage.prompt_tokens, "output_tokens": usage.text_tokens,
                             "total_tokens": usage.prompt_tokens + usage.text_tokens}}]
            case "transcription_failed":
                return [{"type": "conversation.item.input_audio_transcription.failed", "item_id": body.item_id,
                         "content_index": body.content_index, "error": {
                             "type": "server_error", "code": body.error.code, "message": body.error.message,
                             "param": openai_param(body.error.field)}}]
            case "conversation_truncated":
                return []  # the API has no event for it: the items stay, the model no longer sees them
            case "truncated":
                self.truncated(body)
                return [{"type": "conversation.item.truncated", "item_id": body.item_id, "content_index": 0,
                         "audio_end_ms": body.audio_end_ms}]
            case "error":
                if body.field.startswith("update"):
                    self.update_answered(False)
                return [error_event(body.message, openai_param(body.field), openai_code(body), body.event_id or None)]
            case "closed" if body.reason == omni_pb2.CLOSE_REASON_MAX_DURATION:  # OpenAI's code for it
                return [error_event(body.message, None, "session_expired")]
            case "closed":
                reason = omni_pb2.CloseReason.Name(body.reason).removeprefix("CLOSE_REASON_").lower()
                return [error_event(body.message, None, f"session_{reason}", type_="server_error")]
        return []  # codec_frames: not part of the Realtime API

    def settings(self, s: omni_pb2.SessionSettings) -> None:
        """What the events need of the session's settings, from its created/updated events."""
        self.audio_out = AUDIO in s.output_modalities
        self.tools = list(s.tools)
        self.max_output_tokens = s.thinker_sampling.max_new_tokens if s.thinker_sampling.HasField("max_new_tokens") \
            else "inf"
        self.sampling.CopyFrom(s.thinker_sampling)

    def item_events(self, item: dict, previous: str) -> list[dict]:
        self.last_item = item["id"]
        return [self.item_event(t, item, previous) for t in ("added", "done")]

    def item_event(self, kind: str, item: dict, previous: str | None) -> dict:
        """`conversation.item.added` or `.done`; the item kept for retrieval as this says it."""
        self.items[item["id"]] = item
        return {"type": f"conversation.item.{kind}", "item": item, "previous_item_id": previous or None}

    def conversation_item(self, out: Output, kind: str, item: dict, previous: str | None) -> list[dict]:
        """A response's item in the conversation (`conversation.item.added` / `.done`): none for an
        out-of-band response's, which the conversation does not hold."""
        if out.out_of_band:
            return []
        if kind == "added":
            self.last_item = item["id"]
        return [self.item_event(kind, item, previous)]

    def retrieved(self, event: dict) -> dict:
        """`conversation.item.retrieve` answered from the items sent (their audio is not kept)."""
        item_id = event.get("item_id")
        if not isinstance(item_id, str):
            raise ClientEventError("item_id must be a string", "item_id")
        if item_id not in self.items:
            raise ClientEventError(f"Error retrieving item: the item with id {item_id!r} does not exist.", "item_id",
                                   "item_retrieve_invalid_item_id")
        return {"type": "conversation.item.retrieved", "item": self.items[item_id]}

    def transcribed(self, item_id: str, index: int, transcript: str) -> None:
        """A user item's audio part transcribed: retrieval shows its transcript."""
        item = self.items.get(item_id)
        if item is not None and index < len(item.get("content", ())):
            content = list(item["content"])
            content[index] = {**content[index], "transcript": transcript}
            self.items[item_id] = {**item, "content": content}

    def truncated(self, cut: omni_pb2.ItemTruncated) -> None:
        """A cut reply's kept item: its transcript what the conversation keeps of it."""
        item = self.items.get(cut.item_id)
        if item is not None and item.get("type") == "message" and item["content"]:
            part = item["content"][0]
            key = "transcript" if "transcript" in part else "text"
            self.items[cut.item_id] = {**item, "content": [{**part, key: cut.text}]}

    def response(self, rid: str, out: Output, status: str, output: list, **extra) -> dict:
        return {"id": rid, "object": "realtime.response", "status": status, "output": output,
                "output_modalities": ["audio"] if out.audio else ["text"],
                "conversation_id": None if out.out_of_band else "conv_default",
                "max_output_tokens": out.max_output_tokens, "metadata": out.metadata, "status_details": None,
                "usage": None, **extra}

    def response_created(self, rid: str, body: omni_pb2.ResponseCreated) -> list[dict]:
        """A response, as made: the session's settings with its response.create's overrides."""
        out = Output(body.item_id, AUDIO in body.output_modalities, dict(body.metadata) or None,
                     body.max_output_tokens if body.HasField("max_output_tokens") else "inf",
                     AudioOut(self.output_format), out_of_band=body.out_of_band)
        self.responses[rid] = out
        return [{"type": "response.created", "response": self.response(rid, out, "in_progress", [])}]

    def message(self, out: Output, status: str, transcript: str | None = None) -> dict:
        content = [] if transcript is None else [
            {"type": "output_audio", "transcript": transcript} if out.audio else {"type": "output_text", "text": transcript}]
        return {"id": out.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": content}

    def part(self, out: Output, text: str) -> dict:
        """The message's one content part as the content_part events show it."""
        return {"type": "audio", "transcript": text} if out.audio else {"type": "text", "text": text}

    def open_message(self, rid: str, out: Output) -> list[dict]:
        """The message's item and part announced before its first content (nothing once it was)."""
        if out.index is not None:
            return []
        out.index, out.next_index = out.next_index, out.next_index + 1
        item = self.message(out, "in_progress")
        out.previous = self.last_item
        return [{"type": "response.output_item.added", "response_id": rid, "output_index": out.index, "item": item},
                *self.conversation_item(out, "added", item, out.previous),
                {"type": "response.content_part.added", **self.content_ids(rid, out), "part": self.part(out, "")}]

    def content_ids(self, rid: str, out: Output) -> dict:
        return {"response_id": rid, "item_id": out.item_id, "output_index": out.index, "content_index": 0}

    def text_delta(self, rid: str, delta: omni_pb2.TextDelta) -> list[dict]:
        out = self.responses.get(rid)
        text = delta.text
        if delta.token_ids and delta.token_ids[-1] == self.config.end_token_id:
            text = text.removesuffix(self.config.end_token_text)
        if out is None or not text:  # a response's output comes between its created and done
            return []
        kind = "response.output_audio_transcript.delta" if out.audio else "response.output_text.delta"
        return [*self.open_message(rid, out), {"type": kind, **self.content_ids(rid, out), "delta": text}]

    def function_call(self, rid: str, call: omni_pb2.FunctionCall, done: bool) -> list[dict]:
        """A call the reply made, as the thinker streams it: its output item added at its first
        event, each piece of its arguments a delta, then (`done`) its arguments and its item done. A
        call that comes whole has its arguments as one delta."""
        out = self.responses.get(rid)
        if out is None:
            return []
        events = []
        item = {"id": call.item_id, "object": "realtime.item", "type": "function_call", "status": "in_progress",
                "call_id": call.call_id, "name": call.name, "arguments": ""}
        opened = call.item_id not in out.open_calls
        if opened:
            index, out.next_index = out.next_index, out.next_index + 1
            out.open_calls[call.item_id] = OpenCall(index, self.last_item, item)
            events += [{"type": "response.output_item.added", "response_id": rid, "output_index": index, "item": item},
                       *self.conversation_item(out, "added", item, self.last_item)]
        state = out.open_calls[call.item_id]
        index = state.index
        ids = {"response_id": rid, "item_id": call.item_id, "output_index": index, "call_id": call.call_id}
        if call.arguments and (not done or opened):
            events.append({"type": "response.function_call_arguments.delta", **ids, "delta": call.arguments})
            state.arguments += call.arguments
        if not done:
            return events
        del out.open_calls[call.item_id]
        item = {**item, "status": "completed", "arguments": call.arguments}
        out.calls.append((index, item))
        return [*events, {"type": "response.function_call_arguments.done", **ids, "name": call.name,
                          "arguments": call.arguments},
                {"type": "response.output_item.done", "response_id": rid, "output_index": index, "item": item},
                *self.conversation_item(out, "done", item, state.previous)]

    def unfinished_calls(self, rid: str, out: Output) -> list[dict]:
        """Each call still being made when its response ended (a barge-in, a cancel, a failure): its
        item done as `incomplete`, with the arguments streamed so far, and in the response's output."""
        events = []
        for state in out.open_calls.values():
            item = {**state.item, "status": "incomplete", "arguments": state.arguments}
            out.calls.append((state.index, item))
            events += [{"type": "response.output_item.done", "response_id": rid, "output_index": state.index,
                        "item": item}, *self.conversation_item(out, "done", item, state.previous)]
        out.open_calls.clear()
        return events

    def audio_delta(self, rid: str, chunk) -> list[dict]:
        out = self.responses.get(rid)
        if out is None:
            return []
        return self.audio_out_delta(rid, out, out.encoder.feed(audio_codec.float_from_bytes(chunk.pcm)))

    def audio_out_delta(self, rid: str, out: Output, pcm: bytes) -> list[dict]:
        if not pcm:
            return []
        return [*self.open_message(rid, out), {"type": "response.output_audio.delta", **self.content_ids(rid, out),
                                               "delta": base64.b64encode(pcm).decode()}]

    def response_done(self, rid: str, done: omni_pb2.ResponseDone) -> list[dict]:
        out = self.responses.pop(rid, None) or Output(done.item_id, self.audio_out, None, self.max_output_tokens)
        status, details = response_status(done)
        events = self.audio_out_delta(rid, out, out.encoder.finish()) if status in ("completed", "incomplete") else []
        if done.transcript:
            events += self.open_message(rid, out)  # a message with content is in the output, deltas or not
        events += self.unfinished_calls(rid, out)
        output = list(out.calls)
        if out.index is not None:
            message = self.message(out, "completed" if status == "completed" else "incomplete", done.transcript)
            events += self.close_message(rid, out, message, done.transcript)
            output.append((out.index, message))
        usage = done.final.usage
        usage_out = {"total_tokens": usage.prompt_tokens + usage.text_tokens + usage.codec_frames,
                     "input_tokens": usage.prompt_tokens, "output_tokens": usage.text_tokens + usage.codec_frames,
                     "input_token_details": {"text_tokens": usage.prompt_tokens, "audio_tokens": 0, "cached_tokens": 0},
                     "output_token_details": {"text_tokens": usage.text_tokens, "audio_tokens": usage.codec_frames}}
        events.append({"type": "response.done", "response": self.response(
            rid, out, status, [item for _, item in sorted(output, key=lambda pair: pair[0])],
            status_details=details, usage=usage_out)})
        return events

    def close_message(self, rid: str, out: Output, message: dict, text: str) -> list[dict]:
        """The message's done events, each with its final transcript or text."""
        ids = self.content_ids(rid, out)
        if out.audio:
            events = [{"type": "response.output_audio.done", **ids},
                      {"type": "response.output_audio_transcript.done", **ids, "transcript": text}]
        else:
            events = [{"type": "response.output_text.done", **ids, "text": text}]
        return [*events, {"type": "response.content_part.done", **ids, "part": self.part(out, text)},
                {"type": "response.output_item.done", "response_id": rid, "output_index": out.index, "item": message},
                *self.conversation_item(out, "done", message, out.previous)]


def item_content(role: str, added: omni_pb2.ItemAdded) -> list[dict]:
    """A message item's content as the client created it: its text parts, a user's `input_audio`
    (the audio is not echoed; its transcript, when one is made, comes in the transcription events)
    and `input_image` parts, in order."""
    text = "output_text" if role == "assistant" else "input_text"
    if not added.content:  # from a sessions service before ItemAdded.content (a rolling upgrade)
        return [{"type": text, "text": added.text}]
    content = []
    for part in added.content:
        kind = part.WhichOneof("part")
        if kind == "text":
            content.append({"type": text, "text": part.text})
        elif kind == "audio":
            content.append({"type": "input_audio", "transcript": None})
        elif kind == "image":
            content.append({"type": "input_image"})
    return content


def response_status(done: omni_pb2.ResponseDone) -> tuple[str, dict]:
    """response.done's status and status_details: `incomplete` when the thinker stopped at its
    token limit (max_output_tokens, or the thinker's own default)."""
    if done.status == omni_pb2.RESPONSE_STATUS_COMPLETED:
        if done.final.text_finish_reason == common_pb2.FINISH_REASON_LENGTH:
            return "incomplete", {"type": "incomplete", "reason": "max_output_tokens", "error": None}
        return "completed", {"type": "completed", "reason": None, "error": None}
    if done.status == omni_pb2.RESPONSE_STATUS_CANCELLED:
        reason = "turn_detected" if done.cancel_reason == omni_pb2.CANCEL_REASON_TURN_DETECTED else "client_cancelled"
        return "cancelled", {"type": "cancelled", "reason": reason, "error": None}
    return "failed", {"type": "failed", "reason": None,
                      "error": {"type": "server_error", "code": done.error.code, "message": done.error.message}}


def api_error_event(exc: ClientEventError) -> dict:
    return error_event(exc.message, exc.param, exc.code, exc.event_id)
