"""The Realtime API's beta protocol, for a client that asks for it with the `OpenAI-Beta: realtime=v1`
header on the WebSocket handshake (as OpenAI's beta did; the openai SDK's `client.beta.realtime`
sends it): translated to and from the GA events at the edge, so the session, its checks and its
events are the GA protocol's (gateway/realtime_events.py). Shapes as the pinned openai SDK's beta
types (openai/types/beta/realtime/).

In: `session.update`'s flat fields become the GA session's (`modalities` -> `output_modalities`,
`input_audio_format: "pcm16"` -> `audio.input.format`, `turn_detection` -> `audio.input.turn_detection`,
`null` turning detection off, ...); `temperature` the thinker's; the beta content types of an
item (`text`, `audio`) the GA ones; `response.create`'s `modalities` and
`max_response_output_tokens` the GA names. A key the beta protocol does not have is refused by name.

Out: the beta event names (`response.audio.delta`, `response.audio_transcript.delta`,
`response.text.delta` and their `.done`, `conversation.item.created` for GA's
`conversation.item.added`; GA's `conversation.item.done` has no beta event and is not sent),
`conversation.created` after `session.created`, the beta session and response objects, and every
error's `param` named as the beta protocol names it.
"""

from __future__ import annotations

from gateway.realtime_events import ClientEventError, Translator
from omni.v1 import omni_pb2

BETA_HEADER = "realtime=v1"
# The beta audio formats <-> the GA format objects (pcm16 is 24 kHz in the beta protocol).
FORMATS = {"pcm16": {"type": "audio/pcm", "rate": 24000}, "g711_ulaw": {"type": "audio/pcmu"},
           "g711_alaw": {"type": "audio/pcma"}}
FORMAT_NAMES = {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}
# A beta session field -> where the GA session has it (None: at its top level, the same name).
SESSION_FIELDS = {
    "modalities": ("output_modalities",), "voice": ("audio", "output", "voice"),
    "input_audio_format": ("audio", "input", "format"), "output_audio_format": ("audio", "output", "format"),
    "turn_detection": ("audio", "input", "turn_detection"),
    "input_audio_transcription": ("audio", "input", "transcription"),
    "input_audio_noise_reduction": ("audio", "input", "noise_reduction"),
    "max_response_output_tokens": ("max_output_tokens",), "speed": ("audio", "output", "speed"),
    "instructions": None, "tools": None, "tool_choice": None, "tracing": None, "model": None, "temperature": None,
}
# Fields of a response.create the beta protocol names otherwise (the rest have the GA names).
RESPONSE_FIELDS = {"modalities": "output_modalities", "max_response_output_tokens": "max_output_tokens"}
# GA parameter names -> the beta protocol's, longest first (an error's param and message).
PARAMS = sorted([(f"session.{'.'.join(ga)}", f"session.{beta}") for beta, ga in SESSION_FIELDS.items() if ga]
                + [(f"response.{ga}", f"response.{beta}") for beta, ga in RESPONSE_FIELDS.items()],
                key=lambda pair: -len(pair[0]))
EVENTS = {  # GA server event -> the beta protocol's (None: not sent)
    "response.output_audio.delta": "response.audio.delta", "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta", "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created", "conversation.item.done": None,
}
PARTS_OUT = {"output_text": "text", "output_audio": "audio"}  # GA content types -> the beta ones
GA_ONLY = {"response.function_call_arguments.done": ("name",)}  # a GA event's keys the beta one lacks


def asked(headers) -> bool:
    """Whether the handshake's headers ask for the beta protocol (`OpenAI-Beta: realtime=v1`)."""
    return BETA_HEADER in (v.strip() for v in headers.get("openai-beta", "").split(","))


class GA:
    """The GA protocol: events as they are."""

    def incoming(self, event: dict) -> dict:
        """A client event as the GA protocol's; ClientEventError naming what it cannot be."""
        return event

    def amend(self, event: dict, request: omni_pb2.SessionRequest) -> None:
        """What the GA request of `event` cannot say, added to it."""

    def outgoing(self, events: list[dict]) -> list[dict]:
        """GA server events as this protocol's."""
        return events


class Beta(GA):
    def __init__(self, translator: Translator):
        self.translator = translator  # the session's settings as its last created/updated events said

    def incoming(self, event: dict) -> dict:
        match event.get("type"):
            case "session.update":
                return {**event, "session": ga_session(event.get("session"))}
            case "conversation.item.create":
                return {**event, "item": ga_item(event.get("item"))}
            case "response.create" if isinstance(event.get("response"), dict):
                response = {RESPONSE_FIELDS.get(k, k): v for k, v in event["response"].items()}
                if response.get("output_modalities") is not None:
                    response["output_modalities"] = ga_modalities(response["output_modalities"], "response.modalities")
                if isinstance(response.get("input"), list):
                    response["input"] = [ga_item(item) for item in response["input"]]
                return {**event, "response": response}
        return event

    def amend(self, event: dict, request: omni_pb2.SessionRequest) -> None:
        """`session.temperature`: the thinker's, over the session's sampling as it stands (an update of
        the thinker's sampling replaces it whole: its max_new_tokens kept, and the temperature kept
        by an update of max_response_output_tokens alone)."""
        if not request.HasField("update"):
            return
        session = event.get("session") or {}
        temperature = session.get("temperature")
        if temperature is None and not request.update.HasField("thinker_sampling"):
            return
        if temperature is not None and (not isinstance(temperature, int | float) or isinstance(temperature, bool)
                                        or not 0 <= temperature <= 2):
            raise ClientEventError("session.temperature must be a number in [0, 2]", "session.temperature")
        sampling, current = request.update.thinker_sampling, self.translator.sampling
        if "max_response_output_tokens" not in session and current.HasField("max_new_tokens"):
            sampling.max_new_tokens = current.max_new_tokens
        if temperature is not None:
            sampling.temperature = temperature
        elif current.HasField("temperature"):
            sampling.temperature = current.temperature

    def outgoing(self, events: list[dict]) -> list[dict]:
        out = []
        for event in events:
            kind = EVENTS.get(event["type"], event["type"])
            if kind is None:
                continue
            event = {k: v for k, v in event.items() if k not in GA_ONLY.get(kind, ())} | {"type": kind}
            for key in ("item", "response", "session", "error"):
                if key in event:
                    event[key] = getattr(self, f"beta_{key}")(event[key])
            out.append(event)
            if kind == "session.created":
                out.append({"type": "conversation.created", "conversation": {
                    "id": "conv_default", "object": "realtime.conversation"}})
        return out

    def beta_item(self, item: dict) -> dict:
        if "content" not in item:
            return item
        return {**item, "content": [{**part, "type": PARTS_OUT.get(part.get("type"), part.get("type"))}
                                    for part in item["content"]]}

    def beta_response(self, response: dict) -> dict:
        response = {**response}
        modalities = response.pop("output_modalities", None)
        if modalities is not None:
            response["modalities"] = ["text", "audio"] if modalities == ["audio"] else ["text"]
        audio = (response.pop("audio", None) or {}).get("output") or {}
        if audio.get("format"):
            response["output_audio_format"] = FORMAT_NAMES[audio["format"]["type"]]
        if audio.get("voice"):
            response["voice"] = audio["voice"]
        response["output"] = [self.beta_item(item) for item in response.get("output") or []]
        return response

    def beta_session(self, session: dict) -> dict:
        audio_in, audio_out = session["audio"]["input"], session["audio"]["output"]
        detection = audio_in["turn_detection"]
        sampling = self.translator.sampling
        return {
            "id": session["id"], "model": session["model"],
            "modalities": ["text", "audio"] if session["output_modalities"] == ["audio"] else ["text"],
            "instructions": session["instructions"], "voice": audio_out["voice"],
            "input_audio_format": FORMAT_NAMES[audio_in["format"]["type"]],
            "output_audio_format": FORMAT_NAMES[audio_out["format"]["type"]],
            "input_audio_transcription": audio_in["transcription"],
            "input_audio_noise_reduction": audio_in["noise_reduction"],
            "turn_detection": None if detection is None else {
                k: v for k, v in detection.items() if k != "idle_timeout_ms"},
            "tools": session["tools"], "tool_choice": session["tool_choice"],
            "temperature": round(sampling.temperature, 4) if sampling.HasField("temperature") else None,
            "max_response_output_tokens": session["max_output_tokens"], "speed": audio_out["speed"],
            "tracing": session["tracing"],
        }

    def beta_error(self, error: dict) -> dict:
        """An error's field as the beta protocol names it (the GA checks' and the session's errors name
        the GA field), but for a key refused as the client sent it (unknown_parameter: a GA name a
        beta client sent is its own)."""
        param, message = error.get("param"), error.get("message") or ""
        for ga, beta in PARAMS:
            if param == ga and error.get("code") == "unknown_parameter":
                break
            if param and (param == ga or param.startswith((f"{ga}.", f"{ga}["))):
                return {**error, "param": beta + param[len(ga):], "message": message.replace(ga, beta)}
        return error


def ga_session(session) -> dict:
    """A beta `session.update`'s session -> the GA session (its `temperature` left for `amend`);
    ClientEventError naming a key the beta protocol does not have."""
    if not isinstance(session, dict):
        raise ClientEventError("session must be an object", "session")
    ga: dict = {"type": "realtime"}
    for name, value in session.items():
        if name not in SESSION_FIELDS:
            raise ClientEventError(f"Unknown parameter: 'session.{name}' (the beta protocol's session.update)",
                                   f"session.{name}", "unknown_parameter")
        if name == "temperature":
            continue
        if name in ("input_audio_format", "output_audio_format") and value is not None:
            if value not in FORMATS:
                raise ClientEventError(f"session.{name} must be pcm16, g711_ulaw or g711_alaw", f"session.{name}",
                                       "unsupported")
            value = FORMATS[value]
        elif name == "modalities" and value is not None:
            value = ga_modalities(value, "session.modalities")
        *parents, key = SESSION_FIELDS[name] or (name,)
        where = ga
        for parent in parents:
            where = where.setdefault(parent, {})
        where[key] = value
    return ga


def ga_modalities(value, param: str) -> list[str]:
    """Beta modalities (["text", "audio"] in either order, or ["text"]) -> GA output_modalities."""
    if isinstance(value, list) and sorted(value) == ["audio", "text"]:
        return ["audio"]
    if value == ["text"]:
        return ["text"]
    raise ClientEventError(f'{param} must be ["text", "audio"] or ["text"]', param)


def ga_item(item):
    """A beta item's content types (`text`, `audio`: an assistant's) as the GA ones; the rest as it is."""
    if not isinstance(item, dict) or not isinstance(item.get("content"), list):
        return item
    parts = {"text": "output_text", "audio": "output_audio"} if item.get("role") == "assistant" else {}
    return {**item, "content": [{**part, "type": parts.get(part.get("type"), part.get("type"))}
                                if isinstance(part, dict) else part for part in item["content"]]}

