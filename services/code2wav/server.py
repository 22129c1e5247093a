"""Code2Wav gRPC service: codec frames in, PCM chunks out, on one bidirectional stream."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass

import grpc

from omni.v1 import stages_pb2, stages_pb2_grpc
from services.code2wav.engine import (
    Audio,
    Code2WavEngine,
    CodecChunk,
    CodecEnd,
    Decoded,
)
from services.code2wav.qwen2_5 import StreamContext, voices_of
from services.code2wav.qwen2_5_engine import Token2WavEngine, Token2WavStart
from services.runtime.checkpoint import Stage, load_for_serving, load_voices
from services.runtime.chunking import DEFAULT_CHUNKS
from services.runtime.errors import InvalidArgument, UserError, run_cli
from services.runtime.families import DEFAULT_VOICES, Family
from services.runtime.settings import (
    EXACT_CHOICES,
    ModelConfig,
    add_model_flags,
    env_default,
    exact_batching,
    model_config_from_args,
    parse_buckets,
)
from services.serving.config import (
    ServingConfig,
    add_serving_flags,
    serving_config_from_args,
)
from services.serving.engine_loop import (
    EngineLoop,
    EventSink,
    engine_key,
)
from services.serving.grpc_server import ServerHandle, build_server
from services.serving.metrics import StageMetrics
from services.serving.stage_main import serve_stage
from services.serving.status import WireError, abort_for
from services.serving.streams import let_end
from services.serving.tracing import RequestTrace, now_ns
from services.serving.wire import audio_to_proto, frames_from_proto

log = logging.getLogger("code2wav")
SERVICE = stages_pb2.DESCRIPTOR.services_by_name["Code2Wav"].full_name


@dataclass(frozen=True)
class Code2WavConfig:
    serving: ServingConfig
    model: ModelConfig
    left_context: int = 25  # --decoder window: frames of context decoded before each chunk
    decoder: str = "incremental"  # or "window" (see services/code2wav/engine.py)
    delivery_ms: float = 100.0  # a running request's chunk is due this long before its listener runs dry
    # Window lengths captured as CUDA graphs at start-up (others on first use): those of the
    # talker's default chunks (services/runtime/chunking.py) with `left_context` frames of context.
    graph_windows: tuple[int, ...] = DEFAULT_CHUNKS.windows(25)
    # Qwen2.5-Omni's streaming Token2Wav: tokens of context around each chunk (services/code2wav/qwen2_5.py).
    token2wav_context: StreamContext = StreamContext()
    # Qwen2.5-Omni's Token2Wav: each window decoded alone, bit-identical whatever else decodes
    # (services/code2wav/qwen2_5_engine.py); Qwen3-Omni's incremental decoder is per request already.
    exact: bool = True


class Code2WavServicer(stages_pb2_grpc.Code2WavServicer):
    def __init__(self, loop: EngineLoop, engine: Code2WavEngine, handle: ServerHandle, idle_timeout_s: float):
        self.loop = loop
        self.engine = engine
        self.handle = handle
        self.idle_timeout_s = idle_timeout_s
        self.sample_rate = engine.geometry.sample_rate
        # Codec ids the vocoder embeds: the caller's error, refused here naming the field (the
        # engine's own check would end the stream INTERNAL).
        self.codebook_size = (engine.geometry.num_embeds if isinstance(engine, Token2WavEngine)
                              else engine.codebook_size)

    async def Decode(self, request_iterator, context: grpc.aio.ServicerContext):
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("start"):
            await abort_for(context, InvalidArgument("start", "the first message must be start"))
        request_id = first.start.request_id or "anonymous"
        spans = RequestTrace("code2wav", request_id)
        key = engine_key(request_id)  # unique per stream, whatever ids callers reuse
        sink = EventSink(asyncio.get_running_loop())
        added_ns = now_ns()
        self.loop.add(key, self._start_payload(first.start), sink)
        reader = asyncio.create_task(self._read_inputs(key, request_iterator, sink))
        index = 0
        finished = False
        outcome = "cancelled"  # unless the stream ends otherwise (the caller went away)
        try:
            while True:
                match await sink.get(self.idle_timeout_s, "code2wav"):
                    case Audio() as audio:
                        if index == 0:
                            spans.phase("queue", added_ns, sink.first_step_ns)
                            spans.phase("first_chunk", added_ns, samples=int(audio.samples.shape[-1]))
                            spans.open("decode")
                        spans.count("chunks")
                        yield stages_pb2.Code2WavOutput(audio=audio_to_proto(
                            audio.samples, self.sample_rate, index,
                            audio.first_sample // self.engine.geometry.samples_per_frame, audio.end_frame))
                        index += 1
                    case Decoded(samples=samples):
                        finished = True
                        outcome = "ok"
                        spans.close("decode", samples=samples)
                        yield stages_pb2.Code2WavOutput(final=stages_pb2.Code2WavFinal(audio_samples=samples))
                        return
        except grpc.aio.AbortError:
            outcome = "error"
            raise
        except Exception as exc:  # a failed engine or a bad input stream
            # A talker that goes away (cancelled) often reaches the reader as its stream's end before the
            # cancellation reaches the handler: a stream closed without the end mark is abandoned, for the trace.
            gone = context.cancelled() or (isinstance(exc, InvalidArgument) and exc.field == "end")
            outcome = "cancelled" if gone else type(exc).__name__
            await abort_for(context, exc)
        finally:
            spans.finish(outcome)
            let_end(reader)  # never cancelled mid-read (services/serving/streams.py); ends with the call
            if not finished:
                self.loop.abort(key)

    def _start_payload(self, start: stages_pb2.Code2WavStart):
        """What the engine takes with a new request: Token2Wav's voice; nothing for Qwen3's vocoder."""
        if isinstance(self.engine, Token2WavEngine):
            return Token2WavStart(voice=self.engine_voice(start.voice))
        return None

    def engine_voice(self, voice: str) -> str | None:
        """The engine's spelling of `voice` (matched case-insensitively, as the thinker does)."""
        if not voice:
            return None
        names = {name.lower(): name for name in self.engine.voices}
        return names.get(voice.lower(), voice)  # an unknown one fails in the engine, naming it

    async def _read_inputs(self, key: str, request_iterator, sink: EventSink) -> None:
        try:
            async for message in request_iterator:
                if message.HasField("frames"):
                    frames = frames_from_proto(message.frames)
                    if frames.shape[1] != self.engine.num_quantizers:
                        raise InvalidArgument("frames.num_code_groups",
                                              f"must be {self.engine.num_quantizers}, got {frames.shape[1]}")
                    if frames.numel() and (frames.min() < 0 or frames.max() >= self.codebook_size):
                        raise InvalidArgument("frames.ids", f"codec ids must be in [0, {self.codebook_size}), got "
                                                            f"{int(frames.min())}..{int(frames.max())}")
                    self.loop.add_input(key, CodecChunk(frames))
                elif message.HasField("end"):
                    self.loop.add_input(key, CodecEnd())
                    return
                else:
                    raise InvalidArgument("event", "expected frames or end after start")
            # The caller half-closed without an end mark: it gave up on this request.
            raise InvalidArgument("end", "stream closed before the end mark")
        except (InvalidArgument, WireError) as exc:
            sink.fail(exc)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError:
            pass  # the caller went away; the handler's finally aborts the request

    async def GetLoad(self, request, context):
        return self.loop.load_report("code2wav", 0, self.handle.draining, reset_peak=request.reset_peak)


async def create_server(config: Code2WavConfig) -> tuple[ServerHandle, EngineLoop]:
    loaded = load_for_serving(config.model, Stage.CODE2WAV)
    if loaded.family is Family.QWEN2_5_OMNI:
        engine = token2wav_engine(loaded, config)
    else:
        engine = Code2WavEngine(loaded.model, loaded.config, left_context=config.left_context,
                                decoder=config.decoder, graphs=config.model.graphs, graph_windows=config.graph_windows,
                                delivery_ms=config.delivery_ms)
    metrics = StageMetrics("code2wav")
    metrics.serve(config.serving.metrics_port)
    loop = EngineLoop(engine, "code2wav", metrics)
    loop.start()
    handle = build_server(config.serving.host, config.serving.port, (SERVICE,), config.serving.max_message_bytes,
                          tls=config.serving.tls, health_port=config.serving.health_port)
    loop.streams = handle.streams  # LoadReport.in_flight counts open streams
    servicer = Code2WavServicer(loop, engine, handle, config.serving.stream_idle_timeout_s)
    stages_pb2_grpc.add_Code2WavServicer_to_server(servicer, handle.server)
    return handle, loop


def token2wav_engine(loaded, config: Code2WavConfig) -> Token2WavEngine:
    """Qwen2.5-Omni's code2wav: streaming Token2Wav conditioned on the checkpoint's voices."""
    if config.model.graphs.enabled:
        log.warning("CUDA graphs are not implemented for Token2Wav: decoding eagerly")
    mel_dim = loaded.config.token2wav_config.dit_config.mel_dim
    voices = voices_of(load_voices(config.model.checkpoint), mel_dim)
    default = next((n for n in voices if n.lower() == DEFAULT_VOICES[Family.QWEN2_5_OMNI].lower()), next(iter(voices)))
    return Token2WavEngine(loaded.model, voices, default_voice=default, context=config.token2wav_context,
                           exact=config.exact)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-code2wav", description=__doc__)
    add_model_flags(parser)
    add_serving_flags(parser, default_port=50063)
    parser.add_argument("--decoder", choices=["incremental", "window"], default=env_default("decoder", "incremental"),
                        help="incremental (default): the vocoder's transformer keeps a KV cache per request, exact "
                             "for any checkpoint; window: re-decode --left-context frames before each chunk, batched "
                             "across requests (exact only for short-reach vocoders such as the tiny checkpoint's)")
    parser.add_argument("--left-context", type=int, default=env_default("left_context", 25),
                        help="frames of left context decoded before each chunk (default 25)")
    parser.add_argument("--delivery-ms", type=float, default=env_default("delivery_ms", 100.0),
                        help="incremental decoder: how long audio takes from here to the listener; a running "
                             "request's next chunk is decoded first once its listener's audio runs out within "
                             "this (default 100)")
    parser.add_argument("--graph-windows", default=env_default("graph_windows", ""),
                        help="chunk window lengths (context + chunk frames) captured as CUDA graphs at start-up; "
                             "others are captured on first use (default: those of the talker's default chunks, "
                             "4, 8, 16, 25, ..., with --left-context frames of context)")
    parser.add_argument("--token2wav-context", default=env_default("token2wav_context", ""),
                        help="Qwen2.5-Omni only: LEFT:AHEAD[:CHUNK[:VOCODER]] codec tokens of context around each "
                             "streamed chunk (default 96:48:24:32: 109 dB against one whole Token2Wav call on the tiny "
                             "checkpoint, where 48:24 gives 69 dB; "
                             "docs/qwen2_5-omni-token2wav.md has the trade-off table)")
    parser.add_argument("--exact-batching", choices=EXACT_CHOICES, default=env_default("exact_batching", "auto"),
                        help="Qwen2.5-Omni's Token2Wav: on decodes every window alone, bit-identical whatever else "
                             "is decoding (a migrated request's replay needs it); off batches equal-length windows "
                             "across requests (auto: on for cpu, off for cuda; gemm: on). Qwen3-Omni's incremental "
                             "decoder decodes one request at a time either way")
    args = parser.parse_args(argv)

    def run() -> None:
        try:
            context = StreamContext.parse(args.token2wav_context) if args.token2wav_context else StreamContext()
        except ValueError as exc:
            raise UserError(f"--token2wav-context: {exc}") from None
        if args.delivery_ms < 0:
            raise UserError(f"--delivery-ms must be >= 0, got {args.delivery_ms}")
        windows = (parse_buckets(args.graph_windows, "--graph-windows")  # the same syntax: positive integers
                   if args.graph_windows else DEFAULT_CHUNKS.windows(args.left_context))
        config = Code2WavConfig(serving=serving_config_from_args(args), model=model_config_from_args(args),
                                left_context=args.left_context, decoder=args.decoder, graph_windows=windows,
                                delivery_ms=args.delivery_ms,
                                token2wav_context=context, exact=exact_batching(args))
        serve_stage("code2wav", create_server, config, args.port_file)

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
