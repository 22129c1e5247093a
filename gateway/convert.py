"""OpenAI requests -> omni.v1.GenerateRequest (no model, no torch: protobuf and base64 only)."""

from __future__ import annotations

import base64
import binascii
import re

from gateway.audio import AudioTooLong, input_audio_to_wire
from gateway.errors import APIError, bad_request
from gateway.schemas import ChatCompletionRequest, SpeechRequest
from gateway.tools import tool_calls_to_proto, tool_choice_to_proto, tools_to_proto
from omni.v1 import omni_pb2

_ROLES = {"system": omni_pb2.ROLE_SYSTEM, "developer": omni_pb2.ROLE_SYSTEM, "user": omni_pb2.ROLE_USER,
          "assistant": omni_pb2.ROLE_ASSISTANT, "tool": omni_pb2.ROLE_TOOL}
DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)$", re.DOTALL)


def _b64(data: str, param: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(param, f"{param}: not valid base64") from None


def _content(message, i: int, max_audio_seconds: float | None = None) -> list[omni_pb2.Content]:
    where = f"messages[{i}].content"
    if message.content is None or message.content == "" or message.content == []:
        if message.role == "assistant" and message.tool_calls:
            return []  # a turn of calls only
        raise bad_request(where, f"{where}: a message needs content")
    if isinstance(message.content, str):
        return [omni_pb2.Content(text=message.content)]
    parts = []
    for j, part in enumerate(message.content):
        at = f"{where}[{j}]"
        if part.type == "text":
            if part.text is None:
                raise bad_request(f"{at}.text", f"{at}.text is required for a text part")
            parts.append(omni_pb2.Content(text=part.text))
        elif message.role in ("assistant", "tool"):
            raise bad_request(at, f"{at}: {message.role} turns take text parts only")
        elif part.type == "input_audio":
            if part.input_audio is None:
                raise bad_request(f"{at}.input_audio", f"{at}.input_audio is required for an input_audio part")
            raw = _b64(part.input_audio.data, f"{at}.input_audio.data")
            try:
                parts.append(omni_pb2.Content(audio=input_audio_to_wire(raw, part.input_audio.format,
                                                                        max_audio_seconds)))
            except AudioTooLong as exc:
                raise bad_request(f"{at}.input_audio", f"{at}.input_audio: {exc}") from None
            except Exception as exc:  # libsndfile could not read it
                raise bad_request(f"{at}.input_audio.data",
                                  f"{at}.input_audio.data: unreadable {part.input_audio.format}: {exc}") from None
        elif part.type == "image_url":
            parts.append(omni_pb2.Content(image=_data_url(part, at, "image_url", "an")))
        elif part.type == "video_url":
            parts.append(omni_pb2.Content(video=_data_url(part, at, "video_url", "a")))
    return parts


def _data_url(part, at: str, kind: str, article: str) -> bytes:
    """An image_url or video_url part's data: URL -> the file's bytes (the thinker checks the file)."""
    if getattr(part, kind) is None:
        raise bad_request(f"{at}.{kind}", f"{at}.{kind} is required for {article} {kind} part")
    match = DATA_URL.match(getattr(part, kind).url)
    if not match:
        raise bad_request(f"{at}.{kind}.url", f"{at}.{kind}.url: only data: URLs (base64) are accepted; the "
                                              f"gateway fetches nothing from the network", code="unsupported_value")
    return _b64(match["data"], f"{at}.{kind}.url")


def _use_audio_in_video(req: ChatCompletionRequest) -> bool:
    kwargs = req.mm_processor_kwargs or {}
    unknown = sorted(set(kwargs) - {"use_audio_in_video"})
    if unknown:
        raise bad_request("mm_processor_kwargs", f"mm_processor_kwargs: only use_audio_in_video is taken, got "
                                                 f"{', '.join(unknown)}", code="unsupported_value")
    value = kwargs.get("use_audio_in_video", False)
    if not isinstance(value, bool):
        raise bad_request("mm_processor_kwargs.use_audio_in_video", "mm_processor_kwargs.use_audio_in_video: "
                                                                    "must be true or false")
    return value


def chat_to_proto(req: ChatCompletionRequest, default_voice: str | None,
                  max_audio_seconds: float | None = None) -> tuple[omni_pb2.GenerateRequest, bool, str]:
    """-> (request, audio wanted, audio format). mp3 input audio longer than `max_audio_seconds` is
    refused before it is all decoded."""
    if req.n not in (None, 1):
        raise bad_request("n", f"n: only 1 choice is supported, got {req.n}", code="unsupported_value")
    modalities = req.modalities or ["text"]
    if "text" not in modalities:
        raise bad_request("modalities", 'modalities: text is always produced: use ["text"] or ["text", "audio"]')
    audio = "audio" in modalities
    if audio and req.audio is None:
        raise bad_request("audio", 'audio: required when modalities include "audio" (voice and format)')
    fmt = req.audio.format if req.audio is not None else "wav"
    if audio and req.stream and fmt != "pcm16":
        raise bad_request("audio.format", f"audio.format: streamed audio is pcm16 only, got {fmt}",
                          code="unsupported_value")
    out = omni_pb2.GenerateRequest(use_audio_in_video=_use_audio_in_video(req))
    _tools(req, out)
    for i, message in enumerate(req.messages):
        added = out.messages.add(role=_ROLES[message.role])
        added.content.extend(_content(message, i, max_audio_seconds))
        _tool_fields(message, i, added)
    out.output_modalities.append(omni_pb2.MODALITY_TEXT)
    if audio:
        out.output_modalities.append(omni_pb2.MODALITY_AUDIO)
        voice = (req.audio.voice if req.audio is not None else None) or default_voice
        if voice:
            out.voice = voice.lower()
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_completion_tokens", "max_tokens and max_completion_tokens disagree: set one")
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is not None:
        out.thinker_sampling.max_new_tokens = max_tokens
    if req.temperature is not None:
        out.thinker_sampling.temperature = req.temperature
    if req.top_p is not None:
        out.thinker_sampling.top_p = req.top_p
    if req.seed is not None:
        out.thinker_sampling.seed = req.seed % 2**64  # a negative int64 seed as its uint64 bits
    return out, audio, fmt


def _tools(req: ChatCompletionRequest, out: omni_pb2.GenerateRequest) -> None:
    """`tools` and `tool_choice` (checked before anything is decoded)."""
    if req.parallel_tool_calls is False:
        raise bad_request("parallel_tool_calls", "parallel_tool_calls: false is not supported (the model may call "
                                                 "several functions in one reply)", code="unsupported_value")
    if req.tools is not None:
        out.tools.extend(tools_to_proto(req.tools, bad_request))
    if req.tool_choice is not None:
        out.tool_choice.CopyFrom(tool_choice_to_proto(req.tool_choice, list(out.tools), bad_request))


def _tool_fields(message, i: int, out: omni_pb2.Message) -> None:
    """A message's `tool_calls` (assistant) and `tool_call_id` (tool)."""
    if message.tool_calls is not None:
        if message.role != "assistant":
            raise bad_request(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: only an assistant turn makes calls")
        out.tool_calls.extend(tool_calls_to_proto(message.tool_calls, bad_request, f"messages[{i}].tool_calls"))
    if message.role == "tool":
        if not isinstance(message.tool_call_id, str) or not message.tool_call_id:
            raise bad_request(f"messages[{i}].tool_call_id",
                              f"messages[{i}].tool_call_id: a tool message names the call it answers (a string)")
        out.tool_call_id = message.tool_call_id


def speech_to_proto(req: SpeechRequest) -> omni_pb2.GenerateRequest:
    """Text to speech: the user turn holds the text and the assistant's reply is forced to exactly
    that text (GenerateRequest.forced_text), which the talker then speaks."""
    out = omni_pb2.GenerateRequest(voice=req.voice.lower(), forced_text=req.input)
    out.messages.add(role=omni_pb2.ROLE_USER).content.add(text=req.input)
    out.output_modalities.extend([omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO])
    if req.max_audio_frames is not None:
        out.talker_sampling.max_new_tokens = req.max_audio_frames
    return out


def check_size(request: omni_pb2.GenerateRequest, max_message_bytes: int) -> None:
    """413 for a request over the router's message limit (gRPC would refuse it as
    RESOURCE_EXHAUSTED, which callers retry as a 429), naming its largest part."""
    size = request.ByteSize()
    if size <= max_message_bytes:
        return
    param, largest = None, 0
    for i, message in enumerate(request.messages):
        for j, part in enumerate(message.content):
            kind = part.WhichOneof("part")
            length = part.ByteSize()
            if length > largest:
                largest = length
                name = {"audio": ".input_audio", "image": ".image_url"}.get(kind, "")
                param = f"messages[{i}].content[{j}]{name}"
    raise APIError(413, f"the request is {size >> 20} MB as the router takes it, over its "
                        f"{max_message_bytes >> 20} MB message limit"
                        + (f"; its largest part is {param} ({largest >> 20} MB)" if param else ""),
                   "invalid_request_error", param, "request_too_large")
