"""`POST /v1/audio/speech`: text to speech (the reply is forced to the given text), as an audio file
streamed as it is encoded (flac: written whole) or as SSE events (docs/gateway.md)."""

from __future__ import annotations

import asyncio
import base64

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway import audio as audio_codec
from gateway.asgi import CallStream, StreamBroken, sse
from gateway.config import GatewayConfig
from gateway.convert import check_size, speech_to_proto
from gateway.errors import APIError, bad_request
from gateway.process import Gateway
from gateway.router_call import Call
from gateway.schemas import SPEECH_REFUSED, SpeechRequest, check_refused
from omni.v1 import common_pb2, omni_pb2

routes = APIRouter()


@routes.post("/v1/audio/speech")
async def audio_speech(body: SpeechRequest, http: Request) -> Response:
    gateway: Gateway = http.app.state.gateway
    config = gateway.config
    request, fmt = _to_proto(body, config), body.response_format
    cut_is_error = body.max_audio_frames is None  # cut at the talker's default, not at the caller's limit
    call = Call(gateway, request, http, "speech")
    await call.start(http)
    if body.stream_format == "sse":
        return CallStream(call, _events(call, fmt, cut_is_error), "text/event-stream", config.send_timeout_s,
                          {"Cache-Control": "no-cache"})
    if fmt == "pcm" or fmt in audio_codec.STREAMED_FORMATS:
        return CallStream(call, _audio(call, fmt, cut_is_error), audio_codec.MIME[fmt], config.send_timeout_s)
    chunks = []  # flac: written whole (a FLAC stream of unknown length is one few readers take)
    try:
        async for response in call.collected(http):
            if response.WhichOneof("event") == "audio":
                chunks.append(audio_codec.float_from_bytes(response.audio.pcm))
    finally:
        call.cancel()
    data = await asyncio.to_thread(audio_codec.encode, audio_codec.joined(chunks), fmt)
    if (cut := _cut(call, cut_is_error)) is not None:
        raise cut
    return Response(data, media_type=audio_codec.MIME[fmt])


def _to_proto(body: SpeechRequest, config: GatewayConfig) -> omni_pb2.GenerateRequest:
    """The router's request; refused fields, speed, format, the voice and the size checked."""
    check_refused(body, SPEECH_REFUSED)
    if body.speed != 1.0:
        raise bad_request("speed", f"speed: only 1.0 is supported (no time-stretch), got {body.speed}",
                          code="unsupported_value")
    fmt = body.response_format
    if not audio_codec.supported_output(fmt):
        raise bad_request("response_format", f"response_format: {fmt} cannot be encoded here (libsndfile has "
                                             f"no {fmt} encoder); use mp3, opus, flac, wav or pcm",
                          code="unsupported_value")
    request = speech_to_proto(body)
    request.voice = config.voice(body.voice, "voice")
    check_size(request, config.max_message_bytes)
    return request


async def _audio(call: Call, fmt: str, cut_is_error: bool):
    """The audio file as it is encoded (pcm: each chunk's pcm16). A failure after the headers, or
    audio cut at the talker's frame limit, ends the body incomplete (gateway/asgi.py)."""
    encoder = None if fmt == "pcm" else audio_codec.StreamEncoder(fmt)
    try:
        async for response in call.responses():
            if response.WhichOneof("event") != "audio":
                continue
            samples = audio_codec.float_from_bytes(response.audio.pcm)
            if encoder is None:
                yield audio_codec.pcm16_bytes(samples)
            else:
                yield await asyncio.to_thread(encoder.feed, samples)
        if encoder is not None:
            yield await asyncio.to_thread(encoder.finish)
            encoder = None
        if (cut := _cut(call, cut_is_error)) is not None:
            raise StreamBroken(cut.message)
    except grpc.RpcError as err:
        raise StreamBroken(f"the router call failed: {call.error(err).message}") from None
    finally:
        call.cancel()


async def _events(call: Call, fmt: str, cut_is_error: bool):
    """`speech.audio.delta` events as the audio is encoded (flac: one, at the end), then
    `speech.audio.done`; a failure, or audio cut at the talker's frame limit, is an error event
    instead of the done event."""
    encoder = audio_codec.StreamEncoder(fmt) if fmt in audio_codec.STREAMED_FORMATS else None
    chunks = []

    def delta(data: bytes) -> str:
        return sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if data else ""

    try:
        async for response in call.responses():
            if response.WhichOneof("event") != "audio":
                continue
            samples = audio_codec.float_from_bytes(response.audio.pcm)
            if fmt == "pcm":
                yield delta(audio_codec.pcm16_bytes(samples))
            elif encoder is not None:
                yield delta(await asyncio.to_thread(encoder.feed, samples))
            else:
                chunks.append(samples)
        if encoder is not None:
            yield delta(await asyncio.to_thread(encoder.finish))
        elif fmt != "pcm":
            yield delta(await asyncio.to_thread(audio_codec.encode, audio_codec.joined(chunks), fmt))
        if (cut := _cut(call, cut_is_error)) is not None:
            yield cut.sse()
            return
        u = call.usage
        yield sse({"type": "speech.audio.done", "usage": {
            "input_tokens": u.prompt_tokens, "output_tokens": u.codec_frames,
            "total_tokens": u.prompt_tokens + u.codec_frames}})
    except grpc.RpcError as err:
        yield call.error(err).sse()
    finally:
        call.cancel()


def _cut(call: Call, cut_is_error: bool) -> APIError | None:
    """The error of audio cut at the talker's frame limit, unless the caller asked for that limit."""
    final = call.final
    if not cut_is_error or final is None or final.audio_finish_reason != common_pb2.FINISH_REASON_LENGTH:
        return None
    return APIError(500, f"speech cut at the talker's frame limit after {final.usage.codec_frames} frames: the input "
                         "is longer than the talker speaks in one request (set max_audio_frames to accept a cut)",
                    "server_error", "input", "audio_truncated")
