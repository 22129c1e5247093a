"""`omni-gateway`: an OpenAI-compatible HTTP API in front of the router.

`POST /v1/chat/completions` (text, or text and audio, streamed as SSE or not), `POST
/v1/audio/speech` (text to speech: the reply is forced to the given text), `GET /v1/models`,
`GET /health` (ready while the router's omni.v1.Omni is SERVING) and Prometheus `/metrics`.
It is a gRPC client of the router and nothing else: no model, no torch. The caller's
`Authorization: Bearer` header is passed on as gRPC metadata; gRPC statuses become OpenAI-shaped
errors (docs/gateway.md). A caller that goes away cancels its gRPC call, which frees the request
in every stage.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import socket
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import audio as audio_codec
from gateway.asgi import BearerAuth, CallStream, CountAndLimit, IncompleteFilter, StreamBroken, metrics_wsgi_app
from gateway.convert import chat_to_proto, speech_to_proto
from gateway.errors import APIError, bad_request, from_rpc, from_validation
from gateway.schemas import (
    CHAT_REFUSED,
    SPEECH_REFUSED,
    ChatCompletionRequest,
    SpeechRequest,
    refused_fields,
)
from gateway.voices import resolve_voice
from omni.v1 import common_pb2, omni_pb2, omni_pb2_grpc
from services.runtime.errors import UserError, run_cli
from services.runtime.families import DEFAULT_VOICES, Family
from services.runtime.settings import env_default, env_flag
from services.serving import tracing
from services.serving.channels import RotatingChannels
from services.serving.gc_heap import GCCollector, freeze_startup_heap
from services.serving.grpc_server import channel_options, setup_logging
from services.serving.security import TLSConfig, add_tls_flags, load_tokens, tls_from_args
from services.serving.streams import read
from services.serving.tracing import add_tracing_flags, tracing_from_args
from services.serving.tracing import setup as setup_tracing

log = logging.getLogger("gateway")
OMNI_SERVICE = "omni.v1.Omni"
AUDIO_TTL_S = 3600  # `expires_at` of a returned audio: the gateway stores nothing, the id is informational
# Every router call goes round robin over the addresses its target resolves to: one for a Service's
# ClusterIP, every ready router pod for a headless Service (dns:///omni-router-headless:50051).
ROUND_ROBIN = ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]}))
OPEN_PATHS = ("/live", "/health")  # probes: no token (they carry no data)


@dataclass(frozen=True)
class GatewayConfig:
    router: str = "localhost:50051"
    host: str = "0.0.0.0"
    port: int = 8000
    model: str = "qwen3-omni"
    voices: tuple[str, ...] = ()  # the checkpoint's speakers; empty = unknown (the router checks)
    timeout_s: float = 600.0  # deadline of every router call
    tls: TLSConfig = TLSConfig()  # gateway -> router
    max_message_bytes: int = 64 << 20
    max_body_bytes: int = 96 << 20  # HTTP request bodies (base64 makes a 64 MB message about 86 MB)
    end_token_id: int = 151645  # <|im_end|>: its text is not part of an OpenAI reply
    end_token_text: str = "<|im_end|>"
    family: Family = Family.QWEN3_OMNI  # the checkpoint's (its config.json model_type), for the default voice
    auth_tokens: tuple[bytes, ...] = ()  # callers' bearer tokens; empty = no check here (the router may check)
    send_timeout_s: float = 30.0  # a streamed write blocked this long (the client stopped reading) ends the call
    max_audio_seconds: float = 300.0  # per mp3 input audio part (the thinker's --max-audio-seconds default)
    router_refresh_s: float = 60.0  # a new channel (a new DNS resolution) this often: new router pods get calls

    @property
    def default_voice(self) -> str | None:
        """The voice a request without one gets, as the thinker picks it (families.DEFAULT_VOICES)."""
        if not self.voices:
            return None
        default = DEFAULT_VOICES[self.family].lower()
        return default if default in self.voices else self.voices[0]


def read_checkpoint_config(folder: str | Path) -> dict:
    """A checkpoint's config.json (either family), read as JSON (no transformers, no weights)."""
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--checkpoint {folder}: cannot read config.json: {exc}") from None


def family_from_config(config: dict) -> Family:
    """The family its model_type names; Qwen3-Omni when there is none (no --checkpoint)."""
    try:
        return Family(config.get("model_type", Family.QWEN3_OMNI.value))
    except ValueError:
        raise UserError(f"--checkpoint: model_type {config.get('model_type')!r} is no omni family") from None


def voices_from_config(config: dict) -> tuple[str, ...]:
    """Qwen3-Omni: the speakers (talker_config.speaker_id), as services/runtime/prompt.py speaker_names
    reads them. Qwen2.5-Omni keeps its voices in spk_dict.pt, a torch file this process cannot read:
    none here (`omni-serve up` passes them as --voices; without them the thinker checks)."""
    if family_from_config(config) is not Family.QWEN3_OMNI:
        return ()
    return tuple(str(name).lower() for name in (config.get("talker_config") or {}).get("speaker_id", {}))


def end_token_from_config(config: dict) -> int:
    """The thinker's <|im_end|> id: Qwen3-Omni's im_end_token_id, Qwen2.5-Omni's thinker eos_token_id."""
    if family_from_config(config) is Family.QWEN2_5_OMNI:
        value = (config.get("thinker_config") or {}).get("eos_token_id")
    else:
        value = config.get("im_end_token_id")
    return GatewayConfig.end_token_id if value is None else int(value)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        r.register(GCCollector())
        self.requests = Counter("omni_gateway_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("omni_gateway_in_flight", "router calls in progress", registry=r)
        self.ttfb = Histogram("omni_gateway_first_event_seconds",
                              "request received to first router event (text or audio)", ["endpoint"], registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.ttfp = Histogram("omni_gateway_ttfp_seconds", "request received to first audio chunk", ["endpoint"],
                              registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))


class Call:
    """One router Generate call: started, its first response awaited (so that a failure before any
    output is an HTTP status, not a broken stream), then iterated; `cancel()` frees the pipeline."""

    def __init__(self, gateway: Gateway, request: omni_pb2.GenerateRequest, http: Request, endpoint: str):
        self.gateway = gateway
        self.endpoint = endpoint
        self.received = time.perf_counter()
        auth = http.headers.get("authorization")
        metadata = (("authorization", auth),) if auth else None
        self.call = tracing.call("/omni.v1.Omni/Generate", gateway.stub().Generate, request,
                                 timeout=gateway.config.timeout_s, metadata=metadata)
        self.first: omni_pb2.GenerateResponse | None = None
        self.final: omni_pb2.Final | None = None
        self._seen_audio = False
        self._counted = False

    async def start(self, http: Request) -> None:
        """Waits for the first response (the router's queue included), cancelling the call as soon
        as the HTTP client goes away meanwhile."""
        self.gateway.metrics.in_flight.inc()
        watcher = asyncio.create_task(_watch_disconnect(http, self))
        try:
            self.first = await read(self.call)  # never cancelled mid-read (services/serving/streams.py)
        except (grpc.RpcError, asyncio.CancelledError) as err:
            self.done()
            if _left(watcher):
                raise ClientGone from None
            if isinstance(err, asyncio.CancelledError):
                raise
            raise from_rpc(err, speech=self.endpoint == "speech") from None
        except BaseException:
            self.done()
            raise
        finally:
            watcher.cancel()
        if self.first is grpc.aio.EOF:
            self.done()
            raise APIError(502, "the router ended the stream without a response", "server_error", None, "bad_gateway")
        self.gateway.metrics.ttfb.labels(self.endpoint).observe(time.perf_counter() - self.received)

    async def responses(self):
        """Every response, the first included; raises grpc.RpcError if the call fails later."""
        response = self.first
        while response is not grpc.aio.EOF:
            kind = response.WhichOneof("event")
            if kind == "audio" and not self._seen_audio:
                self._seen_audio = True
                self.gateway.metrics.ttfp.labels(self.endpoint).observe(time.perf_counter() - self.received)
            elif kind == "final":
                self.final = response.final
            yield response
            response = await read(self.call)

    def cancel(self) -> None:
        self.call.cancel()  # a no-op once the call ended
        self.done()

    def done(self) -> None:
        if not self._counted:
            self._counted = True
            self.gateway.metrics.in_flight.dec()


class ClientGone(Exception):
    """The HTTP client went away before its response: nothing to send."""


async def _watch_disconnect(http: Request, call: Call) -> bool:
    """True (and the call cancelled) once the client disconnects; runs until cancelled."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            call.cancel()
            return True


def _finish_reason(final: omni_pb2.Final | None, audio: bool) -> str:
    if final is None:
        return "stop"
    reasons = [final.text_finish_reason] + ([final.audio_finish_reason] if audio else [])
    return "length" if common_pb2.FINISH_REASON_LENGTH in reasons else "stop"


def _usage(final: omni_pb2.Final | None) -> dict:
    u = final.usage if final is not None else omni_pb2.Usage()
    completion = u.text_tokens + u.codec_frames
    return {
        "prompt_tokens": u.prompt_tokens, "completion_tokens": completion,
        "total_tokens": u.prompt_tokens + completion,
        "completion_tokens_details": {"text_tokens": u.text_tokens, "audio_tokens": u.codec_frames},
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def reply_text(delta: omni_pb2.TextDelta, config: GatewayConfig) -> str:
    """A text delta's text without the end token's (the pipeline streams `<|im_end|>` as text)."""
    if delta.token_ids and delta.token_ids[-1] == config.end_token_id:
        return delta.text.removesuffix(config.end_token_text)
    return delta.text


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.metrics = Metrics()
        self.channels: RotatingChannels | None = None
        self._stub: tuple[grpc.aio.Channel, omni_pb2_grpc.OmniStub] | None = None
        self._opened = 0.0  # monotonic time the current channel was opened
        self.created = int(time.time())

    async def open(self) -> None:
        options = channel_options(self.config.max_message_bytes) + [ROUND_ROBIN]
        self.channels = RotatingChannels(self.config.tls, options)
        self.channel()

    async def close(self) -> None:
        if self.channels is not None:
            await self.channels.close()

    def channel(self) -> grpc.aio.Channel:
        """The channel to the router for a new call. A new one when the TLS files rotated (its
        handshakes use the new certificate; RotatingChannels) or every `router_refresh_s` (a new DNS
        resolution: router pods added since are called too); the old one closes after its calls."""
        now = time.monotonic()
        if self._stub is not None and now - self._opened > self.config.router_refresh_s:
            self.channels._retire(self._stub[0])
            self.channels._channels.pop(self.config.router, None)
        channel = self.channels.get(self.config.router)
        if self._stub is None or self._stub[0] is not channel:
            self._stub, self._opened = (channel, omni_pb2_grpc.OmniStub(channel)), now
        return channel

    def stub(self) -> omni_pb2_grpc.OmniStub:
        self.channel()
        return self._stub[1]

    def voice(self, voice: str | None, param: str) -> str | None:
        """The checkpoint voice a request's voice names (OpenAI's names mapped: gateway/voices.py);
        400 naming `param` for one the checkpoint does not have."""
        if voice is None:
            return None
        resolved = resolve_voice(voice, self.config.voices, self.config.default_voice)
        if self.config.voices and resolved not in self.config.voices:
            raise bad_request(param, f"{param}: unknown voice {voice!r}; known: "
                                     f"{', '.join(sorted(self.config.voices))} and OpenAI's names (docs/gateway.md)")
        return resolved

    def check_size(self, request: omni_pb2.GenerateRequest) -> None:
        """413 for a request over the router's message limit (gRPC would refuse it as
        RESOURCE_EXHAUSTED, which callers retry as a 429), naming its largest part."""
        size = request.ByteSize()
        if size <= self.config.max_message_bytes:
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
                            f"{self.config.max_message_bytes >> 20} MB message limit"
                            + (f"; its largest part is {param} ({largest >> 20} MB)" if param else ""),
                       "invalid_request_error", param, "request_too_large")

    async def ready(self) -> bool:
        try:
            response = await health_pb2_grpc.HealthStub(self.channel()).Check(
                health_pb2.HealthCheckRequest(service=OMNI_SERVICE), timeout=2.0)
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    # POST /v1/chat/completions
    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        refused = refused_fields(body, CHAT_REFUSED)
        if refused is not None:
            raise bad_request(refused[0], f"{refused[0]}: {refused[1]}", code="unsupported_parameter")
        if _has_media(body):  # base64 and mp3 decoding: off the event loop
            request, audio, fmt = await asyncio.to_thread(chat_to_proto, body, self.config.default_voice,
                                                          self.config.max_audio_seconds)
        else:
            request, audio, fmt = chat_to_proto(body, self.config.default_voice, self.config.max_audio_seconds)
        if audio and request.voice:
            request.voice = self.voice(request.voice, "audio.voice")
        self.check_size(request)
        call = Call(self, request, http, "chat")
        try:
            await call.start(http)
        except ClientGone:
            return Response(status_code=499)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return CallStream(call, self._chat_stream(call, completion_id, audio, include_usage),
                              "text/event-stream", self.config.send_timeout_s, {"Cache-Control": "no-cache"})
        text, chunks = [], []
        try:
            async for response in _until_disconnect(call, http):
                kind = response.WhichOneof("event")
                if kind == "text":
                    text.append(reply_text(response.text, self.config))
                elif kind == "audio":
                    chunks.append(audio_codec.float_from_bytes(response.audio.pcm))
        except ClientGone:
            return Response(status_code=499)  # nobody to send it to; the call is cancelled everywhere
        except grpc.RpcError as err:
            raise from_rpc(err) from None
        finally:
            call.cancel()
        content = "".join(text)
        message: dict = {"role": "assistant", "content": content, "refusal": None}
        if audio:
            message["content"] = None  # OpenAI: with audio out, the text is the audio's transcript
            message["audio"] = {"id": f"audio_{uuid.uuid4().hex}", "data": AUDIO_PLACEHOLDER,
                                "expires_at": int(time.time()) + AUDIO_TTL_S, "transcript": content}
        payload = {
            "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": self.config.model,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(call.final, audio),
                         "logprobs": None}],
            "usage": _usage(call.final), "system_fingerprint": None,
        }
        # Encoding, base64 and the JSON text in a worker thread: a long answer's audio is tens of MB.
        rendered = await asyncio.to_thread(_render_completion, payload, chunks if audio else None, fmt)
        return Response(rendered, media_type="application/json")

    async def _chat_stream(self, call: Call, completion_id: str, audio: bool, include_usage: bool):
        created = int(time.time())
        audio_id = f"audio_{uuid.uuid4().hex}"
        sent_id = False  # OpenAI sends the audio's id and expires_at once: the SDK's stream helper adds them up
        held = b""  # pcm16 bytes held back so that every delta's base64 is unpadded (whole 3-byte groups)

        def chunk(delta: dict, finish: str | None = None) -> str:
            return _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                         "model": self.config.model, "system_fingerprint": None,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

        def audio_delta(fields: dict) -> dict:
            nonlocal sent_id
            if not sent_id:
                sent_id = True
                return {"audio": {"id": audio_id, "expires_at": created + AUDIO_TTL_S, **fields}}
            return {"audio": fields}

        try:
            yield chunk({"role": "assistant", "content": "" if not audio else None})
            async for response in call.responses():
                kind = response.WhichOneof("event")
                text = reply_text(response.text, self.config) if kind == "text" else ""
                if text:
                    yield chunk(audio_delta({"transcript": text}) if audio else {"content": text})
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
            yield chunk({}, _finish_reason(call.final, audio))
            if include_usage:
                yield _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                            "model": self.config.model, "choices": [], "usage": _usage(call.final)})
            yield "data: [DONE]\n\n"
        except grpc.RpcError as err:  # after the 200: the error travels as an SSE event
            yield from_rpc(err).sse()
        finally:
            call.cancel()

    # POST /v1/audio/speech
    async def speech(self, body: SpeechRequest, http: Request) -> Response:
        refused = refused_fields(body, SPEECH_REFUSED)
        if refused is not None:
            raise bad_request(refused[0], f"{refused[0]}: {refused[1]}", code="unsupported_parameter")
        if body.speed != 1.0:
            raise bad_request("speed", f"speed: only 1.0 is supported (no time-stretch), got {body.speed}",
                              code="unsupported_value")
        fmt = body.response_format
        if not audio_codec.supported_output(fmt):
            raise bad_request("response_format", f"response_format: {fmt} cannot be encoded here (libsndfile has "
                                                 f"no {fmt} encoder); use mp3, opus, flac, wav or pcm",
                              code="unsupported_value")
        request = speech_to_proto(body)
        request.voice = self.voice(body.voice, "voice")
        self.check_size(request)
        cut_is_error = body.max_audio_frames is None  # cut at the talker's default, not at the caller's limit
        call = Call(self, request, http, "speech")
        try:
            await call.start(http)
        except ClientGone:
            return Response(status_code=499)
        if body.stream_format == "sse":
            return CallStream(call, self._speech_sse(call, fmt, cut_is_error), "text/event-stream", self.config.send_timeout_s,
                              {"Cache-Control": "no-cache"})
        if fmt == "pcm" or fmt in audio_codec.STREAMED_FORMATS:
            return CallStream(call, self._speech_audio(call, fmt, cut_is_error), audio_codec.MIME[fmt],
                              self.config.send_timeout_s)
        chunks = []  # flac: written whole (a FLAC stream of unknown length is one few readers take)
        try:
            async for response in _until_disconnect(call, http):
                if response.WhichOneof("event") == "audio":
                    chunks.append(audio_codec.float_from_bytes(response.audio.pcm))
        except ClientGone:
            return Response(status_code=499)
        except grpc.RpcError as err:
            raise from_rpc(err, speech=True) from None
        finally:
            call.cancel()
        import numpy as np

        samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        data = await asyncio.to_thread(audio_codec.encode, samples, fmt)
        if cut_is_error and _speech_finish(call.final) == "length":
            raise _cut(call.final)
        return Response(data, media_type=audio_codec.MIME[fmt])

    async def _speech_audio(self, call: Call, fmt: str, cut_is_error: bool):
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
            if cut_is_error and _speech_finish(call.final) == "length":
                raise StreamBroken(_cut(call.final).message)
        except grpc.RpcError as err:
            raise StreamBroken(f"the router call failed: {from_rpc(err, speech=True).message}") from None
        finally:
            call.cancel()

    async def _speech_sse(self, call: Call, fmt: str, cut_is_error: bool):
        """`speech.audio.delta` events as the audio is encoded (flac: one, at the end), then
        `speech.audio.done`; a failure, or audio cut at the talker's frame limit, is an error event
        instead of the done event."""
        encoder = audio_codec.StreamEncoder(fmt) if fmt in audio_codec.STREAMED_FORMATS else None
        chunks = []

        def delta(data: bytes) -> str:
            return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if data else ""

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
                import numpy as np

                samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
                yield delta(await asyncio.to_thread(audio_codec.encode, samples, fmt))
            if cut_is_error and _speech_finish(call.final) == "length":
                yield _cut(call.final).sse()
                return
            u = call.final.usage if call.final is not None else omni_pb2.Usage()
            yield _sse({"type": "speech.audio.done", "usage": {
                "input_tokens": u.prompt_tokens, "output_tokens": u.codec_frames,
                "total_tokens": u.prompt_tokens + u.codec_frames}})
        except grpc.RpcError as err:
            yield from_rpc(err, speech=True).sse()
        finally:
            call.cancel()

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.config.model, "object": "model", "created": self.created, "owned_by": "omni-serve",
                "voices": list(self.config.voices), "default_voice": self.config.default_voice,
                "modalities": ["text", "audio"]}


AUDIO_PLACEHOLDER = "\x00audio\x00"  # where a non-streamed reply's base64 goes into its JSON text


def _has_media(body: ChatCompletionRequest) -> bool:
    return any(not isinstance(m.content, str) and any(p.type != "text" for p in m.content or ())
               for m in body.messages)


def _render_completion(payload: dict, chunks: list | None, fmt: str) -> bytes:
    """The chat.completion JSON; its audio encoded and base64'd straight into the text (json.dumps of
    the base64 string would copy and scan tens of MB for characters that base64 never holds)."""
    text = json.dumps(payload, separators=(",", ":"))
    if chunks is None:
        return text.encode()
    import numpy as np

    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    data = base64.b64encode(audio_codec.encode(samples, fmt))
    head, tail = text.encode().split(json.dumps(AUDIO_PLACEHOLDER).encode(), 1)
    return b"".join((head, b'"', data, b'"', tail))


def _speech_finish(final: omni_pb2.Final | None) -> str:
    return "length" if final is not None and final.audio_finish_reason == common_pb2.FINISH_REASON_LENGTH else "stop"


def _cut(final: omni_pb2.Final | None) -> APIError:
    frames = final.usage.codec_frames if final is not None else 0
    return APIError(500, f"speech cut at the talker's frame limit after {frames} frames: the input is longer "
                         "than the talker speaks in one request (set max_audio_frames to accept a cut)",
                    "server_error", "input", "audio_truncated")


async def _until_disconnect(call: Call, http: Request):
    """The call's responses; cancels it if the HTTP client goes away while we collect (non-streamed
    responses have no body to fail on, so the disconnect is watched for), and then raises
    ClientGone instead of the call's CANCELLED."""
    watcher = asyncio.create_task(_watch_disconnect(http, call))
    try:
        async for response in call.responses():
            yield response
    except (grpc.RpcError, asyncio.CancelledError):
        if _left(watcher):
            raise ClientGone from None
        raise
    finally:
        watcher.cancel()


def _left(watcher: asyncio.Task) -> bool:
    """The client went away (the watcher saw it and cancelled the call), and this task itself is not
    being cancelled: a read of a cancelled grpc.aio call raises CancelledError (or CANCELLED), which
    is then only how the call ended, not an order to stop."""
    task = asyncio.current_task()
    return (watcher.done() and not watcher.cancelled() and watcher.result()
            and not (task is not None and task.cancelling()))


def create_app(config: GatewayConfig) -> FastAPI:
    gateway = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.open()
        yield
        await gateway.close()

    app = FastAPI(title="omni-gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.add_middleware(CountAndLimit, requests=gateway.metrics.requests, max_body_bytes=config.max_body_bytes)
    # Outermost: a caller without a token is refused before its body is read or counted.
    app.add_middleware(BearerAuth, tokens=config.auth_tokens, open_paths=OPEN_PATHS, denied=lambda: APIError(
        401, "missing or invalid bearer token (Authorization: Bearer <token>)", "invalid_request_error", None,
        "invalid_api_key", {"WWW-Authenticate": "Bearer"}).response())
    _add_error_handlers(app)
    _add_api_routes(app, gateway)
    _add_probe_routes(app, gateway)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body: ours, pydantic's (422 -> 400 naming the field), Starlette's."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return from_validation(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()


def _add_api_routes(app: FastAPI, gateway: Gateway) -> None:
    model = gateway.config.model

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await gateway.chat(body, request)

    @app.post("/v1/audio/speech")
    async def audio_speech(body: SpeechRequest, request: Request):
        return await gateway.speech(body, request)

    @app.get("/v1/models")
    async def list_models():
        return gateway.models()

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str):
        if model_id != model:
            raise APIError(404, f"model {model_id!r} not found; served: {model}", "invalid_request_error",
                           "model", "model_not_found")
        return gateway.model_card()


def _add_probe_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/live")
    async def live():
        """Liveness: the process answers (it does not follow the router, so a router outage does not
        restart every gateway)."""
        return {"status": "ok"}

    @app.get("/health")
    async def health():
        if await gateway.ready():
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable", "router": gateway.config.router}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def listen_socket(host: str, port: int, send_buffer_bytes: int = 256 << 10) -> socket.socket:
    """The bound listening socket uvicorn serves on (port 0: any free one).

    proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    accepted sockets inherit this one's proto. Without it every SSE event after the headers waits
    for the client's delayed ACK (about 40 ms on Linux) once a kept-alive connection is reused."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit a fixed send buffer: with Linux's autotuning (up to tcp_wmem's 4 MB) a
    # client that stops reading left seconds of audio in the kernel before a write blocked and the
    # send timeout could see it. 256 kB is 4 s of SSE pcm16 audio at 24 kHz, and 2.5 MB/s at 100 ms RTT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind((host, port))
    return sock


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--router", default=env_default("router", "localhost:50051"), help="router host:port")
    parser.add_argument("--host", default=env_default("host", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=env_default("http_port", 8000),
                        help="HTTP port (default 8000; 0 = any free port, see --port-file)")
    parser.add_argument("--checkpoint", default=env_default("checkpoint", None),
                        help="read the model name, family and voices from this checkpoint's config.json (JSON "
                             "only: a Qwen2.5-Omni checkpoint's voices come with --voices)")
    parser.add_argument("--model-name", default=env_default("model_name", None),
                        help="the model id /v1/models lists (default: the checkpoint folder's name, or qwen3-omni)")
    parser.add_argument("--voices", default=env_default("voices", None),
                        help="comma-separated voices (default: the checkpoint's speakers; none = the router checks)")
    parser.add_argument("--timeout-s", type=float, default=env_default("timeout_s", 600.0),
                        help="deadline of every router call (default 600)")
    parser.add_argument("--max-message-mb", type=int, default=env_default("max_message_mb", 64),
                        help="largest gRPC message to or from the router (default 64)")
    parser.add_argument("--max-body-mb", type=int, default=env_default("max_body_mb", 96),
                        help="largest HTTP request body; over it: 413 (default 96)")
    parser.add_argument("--metrics-port", type=int, default=env_default("metrics_port", 0),
                        help="also serve Prometheus metrics on this port (0 = only /metrics on --port)")
    parser.add_argument("--grace-s", type=float, default=env_default("grace_s", 30.0),
                        help="on SIGTERM: stop accepting, give open streams this long (default 30)")
    parser.add_argument("--port-file", help="write the bound port here once listening")
    parser.add_argument("--auth-token-file", default=env_default("auth_token_file", None),
                        help="bearer tokens callers must present (one per line; also OMNI_AUTH_TOKENS, comma-"
                             "separated): every route but /live and /health, /metrics and --metrics-port included")
    parser.add_argument("--require-auth", action="store_true", default=env_flag("require_auth"),
                        help="refuse to start without tokens (Kubernetes: no open port by mistake)")
    parser.add_argument("--send-timeout-s", type=float, default=env_default("send_timeout_s", 30.0),
                        help="a streamed response whose client takes no bytes for this long is ended and its "
                             "router call cancelled (default 30)")
    parser.add_argument("--send-buffer-kb", type=int, default=env_default("send_buffer_kb", 256),
                        help="kernel send buffer of each client connection (default 256: 4 s of streamed "
                             "audio; smaller: a client that stops reading is noticed sooner)")
    parser.add_argument("--max-audio-seconds", type=float, default=env_default("max_audio_seconds", 300.0),
                        help="longest mp3 input audio part, decoded here (default 300, the thinker's default)")
    parser.add_argument("--router-refresh-s", type=float, default=env_default("router_refresh_s", 60.0),
                        help="open a new channel to the router this often, so that a DNS name's new router "
                             "pods get calls (default 60; calls go round robin over its addresses)")
    add_tls_flags(parser)
    add_tracing_flags(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    checkpoint = read_checkpoint_config(args.checkpoint) if args.checkpoint else {}
    voices = voices_from_config(checkpoint)
    if args.voices:
        voices = tuple(v.strip().lower() for v in args.voices.split(",") if v.strip())
    tokens = load_tokens(args.auth_token_file)
    if args.require_auth and not tokens:
        raise UserError("--require-auth: no tokens (--auth-token-file or OMNI_AUTH_TOKENS)")
    return GatewayConfig(
        router=args.router, host=args.host, port=args.port, voices=voices,
        model=args.model_name or (Path(args.checkpoint).name if args.checkpoint else "qwen3-omni"),
        timeout_s=args.timeout_s, tls=tls_from_args(args), max_message_bytes=args.max_message_mb << 20,
        max_body_bytes=args.max_body_mb << 20, end_token_id=end_token_from_config(checkpoint),
        family=family_from_config(checkpoint), auth_tokens=tokens, send_timeout_s=args.send_timeout_s,
        max_audio_seconds=args.max_audio_seconds, router_refresh_s=args.router_refresh_s)


def serve_metrics(host: str, port: int, registry, tokens: tuple[bytes, ...]) -> None:
    """`--metrics-port`: Prometheus metrics on a port of their own, from a thread (WSGI)."""
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = make_server(host, port, metrics_wsgi_app(registry, tokens), handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()


def serve(config: GatewayConfig, args: argparse.Namespace) -> None:
    import uvicorn

    setup_logging("gateway", args.log_format)
    setup_tracing("gateway", tracing_from_args(args), args.port)
    logging.getLogger("uvicorn.error").addFilter(IncompleteFilter())
    try:
        sock = listen_socket(config.host, config.port, args.send_buffer_kb << 10)
    except OSError as exc:
        raise UserError(f"cannot listen on {config.host}:{config.port}: {exc}") from None
    port = sock.getsockname()[1]
    app = create_app(config)
    if args.metrics_port:
        serve_metrics(config.host, args.metrics_port, app.state.gateway.metrics.registry, config.auth_tokens)
    # Keep-alive longer than the usual 60 s idle timeout of load balancers, so they close first.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=75,
                                           timeout_graceful_shutdown=args.grace_s))
    tokens = config.auth_tokens
    log.info("omni-gateway on %s:%d -> router %s (model %s, voices %s, %s)", config.host, port, config.router,
             config.model, ",".join(config.voices) or "?", f"{len(tokens)} tokens" if tokens else "no token check")
    log.info("froze %d start-up objects out of garbage collection", freeze_startup_heap())
    if args.port_file:
        Path(args.port_file).write_text(str(port))
    server.run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(lambda: serve(config_from_args(args), args))


if __name__ == "__main__":
    sys.exit(main())
