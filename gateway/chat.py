"""`POST /v1/chat/completions`: text, or text and audio, as one chat.completion or streamed as SSE
chunks (docs/gateway.md).

With tools, the thinker parses the reply's calls (services/thinker/tool_calls.py): its text deltas
are the message's content (or audio transcript), and each call (its `tool_call_delta` and
`tool_call` events) a `tool_calls` entry, streamed as its id and name, then its arguments as the
model writes them, and the finish reason "tool_calls". The pipeline speaks none of a call
(services/thinker/stream.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway import audio as audio_codec
from gateway.asgi import CallStream, sse
from gateway.config import GatewayConfig
from gateway.convert import chat_to_proto, check_size
from gateway.process import Gateway
from gateway.router_call import Call
from gateway.schemas import CHAT_REFUSED, ChatCompletionRequest, check_refused
from gateway.tools import openai_call
from omni.v1 import common_pb2, omni_pb2

AUDIO_TTL_S = 3600  # `expires_at` of a returned audio: the gateway stores nothing, the id is informational
AUDIO_PLACEHOLDER = "\x00audio\x00"  # where a non-streamed reply's base64 goes into its JSON text
routes = APIRouter()


@routes.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
    gateway: Gateway = http.app.state.gateway
    request, audio, fmt = await _to_proto(body, gateway.config)
    call = Call(gateway, request, http, "chat")
    await call.start(http)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return CallStream(call, _chunks(call, gateway.config, completion_id, audio, include_usage),
                          "text/event-stream", gateway.config.send_timeout_s, {"Cache-Control": "no-cache"})
    return await _completion(call, http, gateway.config, completion_id, audio, fmt)


async def _to_proto(body: ChatCompletionRequest, config: GatewayConfig) -> tuple[omni_pb2.GenerateRequest, bool, str]:
    """The router's request, audio wanted, and its format; refused fields, the voice and the size checked."""
    check_refused(body, CHAT_REFUSED)
    args = (body, config.default_voice, config.max_audio_seconds)
    if _has_media(body):  # base64 and mp3 decoding: off the event loop
        request, audio, fmt = await asyncio.to_thread(chat_to_proto, *args)
    else:
        request, audio, fmt = chat_to_proto(*args)
    if audio and request.voice:
        request.voice = config.voice(request.voice, "audio.voice")
    check_size(request, config.max_message_bytes)
    return request, audio, fmt


async def _completion(call: Call, http: Request, config: GatewayConfig, completion_id: str, audio: bool,
                      fmt: str) -> Response:
    """The whole reply as one chat.completion."""
    text, chunks, calls = [], [], []
    try:
        async for response in call.collected(http):
            kind = response.WhichOneof("event")
            if kind == "text":
                text.append(reply_text(response.text, config))
            elif kind == "audio":
                chunks.append(audio_codec.float_from_bytes(response.audio.pcm))
            elif kind == "tool_call":
                calls.append(openai_call(response.tool_call))
    finally:
        call.cancel()
    content = "".join(text)
    message: dict = {"role": "assistant", "content": content or (None if calls else ""), "refusal": None}
    if calls:
        message["tool_calls"] = calls
    audio = audio and not (calls and not chunks)  # a reply that is only calls has no audio
    if audio:
        message["content"] = None  # OpenAI: with audio out, the text is the audio's transcript
        message["audio"] = {"id": f"audio_{uuid.uuid4().hex}", "data": AUDIO_PLACEHOLDER,
                            "expires_at": int(time.time()) + AUDIO_TTL_S, "transcript": content}
    payload = {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": config.model,
        "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(call.final, audio, bool(calls)),
                     "logprobs": None}],
        "usage": _usage(call.usage), "system_fingerprint": None,
    }
    # Encoding, base64 and the JSON text in a worker thread: a long answer's audio is tens of MB.
    rendered = await asyncio.to_thread(_render_completion, payload, chunks if audio else None, fmt)
    return Response(rendered, media_type="application/json")


async def _chunks(call: Call, config: GatewayConfig, completion_id: str, audio: bool, include_usage: bool):
    """The reply as chat.completion.chunk events as the pipeline makes it, then `data: [DONE]`."""
    created = int(time.time())
    calls: dict[str, int] = {}  # a call's id -> its index in the reply
    audio_id = f"audio_{uuid.uuid4().hex}"
    sent_id = False  # OpenAI sends the audio's id and expires_at once: the SDK's stream helper adds them up
    held = b""  # pcm16 bytes held back so that every delta's base64 is unpadded (whole 3-byte groups)

    def chunk(delta: dict, finish: str | None = None) -> str:
        return sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                    "model": config.model, "system_fingerprint": None,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    def audio_delta(fields: dict) -> dict:
        nonlocal sent_id
        if not sent_id:
            sent_id = True
            return {"audio": {"id": audio_id, "expires_at": created + AUDIO_TTL_S, **fields}}
        return {"audio": fields}

    def call_chunk(kind: str, event) -> str | None:
        """A call's first delta: its id, name and arguments so far; then its arguments' pieces. A
        call that comes whole (no delta before it) is one chunk; one that streamed has no more."""
        if event.id not in calls:
            calls[event.id] = len(calls)
            return chunk({"tool_calls": [openai_call(event, calls[event.id])]})
        if kind == "tool_call_delta" and event.arguments:
            return chunk({"tool_calls": [{"index": calls[event.id], "function": {"arguments": event.arguments}}]})
        return None

    try:
        yield chunk({"role": "assistant", "content": "" if not audio else None})
        async for response in call.responses():
            kind = response.WhichOneof("event")
            text = reply_text(response.text, config) if kind == "text" else ""
            if text:
                yield chunk(audio_delta({"transcript": text}) if audio else {"content": text})
            elif kind in ("tool_call_delta", "tool_call"):
                event = call_chunk(kind, getattr(response, kind))
                if event is not None:
                    yield event
            elif kind == "audio":
                # NOTE: the helper concatenates the deltas' base64 strings; that decodes only if
                # no delta but the last ends in padding, so each carries a multiple of 6 bytes.
                pcm = held + audio_codec.pcm16_bytes(audio_codec.float_from_bytes(response.audio.pcm))
                cut = len(pcm) - len(pcm) % 6
                pcm, held = pcm[:cut], pcm[cut:]
                if pcm:
                    yield chunk(audio_delta({"data": base64.b64encode(pcm).decode()}))
        if held:
            yield chunk(audio_delta({"data": base64.b64encode(held).decode()}))
        yield chunk({}, _finish_reason(call.final, audio, bool(calls)))
        if include_usage:
            yield sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                       "model": config.model, "choices": [], "usage": _usage(call.usage)})
        yield "data: [DONE]\n\n"
    except grpc.RpcError as err:  # after the 200: the error travels as an SSE event
        yield call.error(err).sse()
    finally:
        call.cancel()


def reply_text(delta: omni_pb2.TextDelta, config: GatewayConfig) -> str:
    """A text delta's text without the end token's (the pipeline streams `<|im_end|>` as text)."""
    if delta.token_ids and delta.token_ids[-1] == config.end_token_id:
        return delta.text.removesuffix(config.end_token_text)
    return delta.text


def _finish_reason(final: omni_pb2.Final | None, audio: bool, called: bool = False) -> str:
    if called:
        return "tool_calls"
    if final is None:
        return "stop"
    reasons = [final.text_finish_reason] + ([final.audio_finish_reason] if audio else [])
    return "length" if common_pb2.FINISH_REASON_LENGTH in reasons else "stop"


def _usage(u: omni_pb2.Usage) -> dict:
    completion = u.text_tokens + u.codec_frames
    return {
        "prompt_tokens": u.prompt_tokens, "completion_tokens": completion,
        "total_tokens": u.prompt_tokens + completion,
        "completion_tokens_details": {"text_tokens": u.text_tokens, "audio_tokens": u.codec_frames},
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _has_media(body: ChatCompletionRequest) -> bool:
    return any(not isinstance(m.content, str) and any(p.type != "text" for p in m.content or ())
               for m in body.messages)


def _render_completion(payload: dict, chunks: list | None, fmt: str) -> bytes:
    """The chat.completion JSON; its audio encoded and base64'd straight into the text (json.dumps of
    the base64 string would copy and scan tens of MB for characters that base64 never holds)."""
    text = json.dumps(payload, separators=(",", ":"))
    if chunks is None:
        return text.encode()
    data = base64.b64encode(audio_codec.encode(audio_codec.joined(chunks), fmt))
    head, tail = text.encode().split(json.dumps(AUDIO_PLACEHOLDER).encode(), 1)
    return b"".join((head, b'"', data, b'"', tail))
