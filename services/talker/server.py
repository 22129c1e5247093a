"""Talker gRPC service: hidden-state chunks in from the thinker, codec frames out to code2wav,
audio passed back up the same stream."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time

import grpc
import torch

from omni.v1 import common_pb2, stages_pb2, stages_pb2_grpc
from services.runtime.checkpoint import Stage, load_for_serving
from services.runtime.chunking import ChunkPolicy, FrameChunker
from services.runtime.errors import InvalidArgument, UserError, run_cli
from services.runtime.families import Family, family_of
from services.runtime.settings import (
    GraphSettings,
    add_engine_flags,
    add_model_flags,
    env_default,
    exact_batching,
    exact_gemm,
    model_config_from_args,
)
from services.serving import tracing
from services.serving.channels import ChannelPool
from services.serving.config import (
    add_serving_flags,
    serving_config_from_args,
)
from services.serving.convert import finish_reason_to_proto
from services.serving.engine_loop import (
    EngineLoop,
    EventSink,
    engine_key,
)
from services.serving.grpc_server import (
    ServerHandle,
    build_server,
    time_remaining,
)
from services.serving.metrics import StageMetrics
from services.serving.migration import Downstream, Resume
from services.serving.stage_main import serve_stage
from services.serving.status import ReplayDiverged, StageUnavailable, WireError, abort_for
from services.serving.streams import let_end
from services.serving.tracing import RequestTrace, now_ns
from services.serving.wire import frames_to_proto
from services.talker.adapter import TalkerAdapter
from services.talker.config import TalkerConfig
from services.talker.engine import Frame, TalkerDone, TalkerEngineConfig, TextEnd
from services.talker.qwen2_5_adapter import Qwen2_5TalkerAdapter
from services.talker.qwen3_adapter import Qwen3TalkerAdapter

log = logging.getLogger("talker")
SERVICE = stages_pb2.DESCRIPTOR.services_by_name["Talker"].full_name


# family -> its adapter (adapter.py), picked once at start by the checkpoint's model_type
ADAPTERS = {Family.QWEN3_OMNI: Qwen3TalkerAdapter, Family.QWEN2_5_OMNI: Qwen2_5TalkerAdapter}


def replay_cuts_from_proto(start: stages_pb2.TalkerStart) -> tuple[int, ...]:
    """A replay's cuts (services/runtime/chunking.py, "replays"): increasing frame counts."""
    cuts = tuple(start.replay_cuts)
    if any(b <= a for a, b in zip((0, *cuts), cuts)):
        raise InvalidArgument("start.replay_cuts", f"must be increasing frame counts above 0, got {list(cuts)}")
    return cuts


class TalkerServicer(stages_pb2_grpc.TalkerServicer):
    def __init__(self, loop: EngineLoop, engine, config: TalkerConfig, adapter: TalkerAdapter, handle: ServerHandle):
        self.loop = loop
        self.handle = handle
        self.engine = engine
        self.config = config
        self.adapter = adapter  # the family's: start message -> job, text inputs -> engine inputs
        self.channels = ChannelPool(config.serving.max_message_bytes, config.serving.tls)
        self.metrics: StageMetrics = loop.metrics

    async def Speak(self, request_iterator, context: grpc.aio.ServicerContext):
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("start"):
            await abort_for(context, InvalidArgument("start", "the first message must be start"))
        start = first.start
        try:
            job = self.adapter.job_from_proto(start)
            cuts = replay_cuts_from_proto(start)
        except (InvalidArgument, WireError) as exc:
            await abort_for(context, exc)
        if not start.route.code2wav:
            await abort_for(context, InvalidArgument("route.code2wav", "no code2wav replica given"))
        request_id = start.request_id or "anonymous"
        spans = RequestTrace("talker", request_id, **{"omni.replay": bool(cuts)})
        key = engine_key(request_id)  # unique per stream, whatever ids callers reuse
        sink = EventSink(asyncio.get_running_loop())
        added_ns = now_ns()
        self.loop.add(key, job, sink)
        reader = asyncio.create_task(self._read_text(key, request_iterator, sink))
        route = start.route
        decode = Downstream(
            "talker", "code2wav", [route.code2wav, *route.code2wav_fallbacks],
            lambda address: tracing.call("/omni.v1.Code2Wav/Decode",
                                         stages_pb2_grpc.Code2WavStub(self.channels.get(address)).Decode,
                                         timeout=time_remaining(context)),
            sink, lambda out: out.HasField("final"), route.max_migrations, self.metrics,
            stall_timeout_s=self.config.serving.stall_timeout_s(stages_below=0))
        decode.open()
        resume = Resume("code2wav")  # what went up from code2wav, across moves
        chunker = FrameChunker(self.config.chunks, self.adapter.seconds_per_frame, cuts)
        done: TalkerDone | None = None
        outcome = "cancelled"  # unless the stream ends otherwise (the caller went away)
        try:
            await decode.write(stages_pb2.Code2WavInput(start=stages_pb2.Code2WavStart(request_id=request_id,
                                                                                         voice=start.voice)))
            while True:
                try:
                    item = await sink.get(self.config.serving.stall_timeout_s(stages_below=1), "talker")
                except StageUnavailable as exc:
                    if not await decode.recover(exc):
                        raise
                    resume.begin_replay()
                    continue
                match item:
                    case Frame(codes=codes):
                        if spans.first("frame"):
                            spans.phase("queue", added_ns, sink.first_step_ns)
                            spans.phase("prefill", sink.first_step_ns or added_ns)
                            spans.open("decode")
                        spans.count("frames")
                        chunk = chunker.add(codes, time.monotonic())
                        if chunk is not None:
                            if spans.first("chunk"):
                                spans.phase("first_chunk", added_ns, frames=int(chunk.shape[0]))
                            spans.count("chunks")
                            async for out in self._send_chunk(decode, chunk, chunker, start.return_codec_frames):
                                yield out
                    case TalkerDone() as talker_done:
                        done = talker_done
                        spans.close("decode", frames=talker_done.frames, finish_reason=talker_done.reason.name)
                        chunk = chunker.flush()
                        if chunk is not None:
                            async for out in self._send_chunk(decode, chunk, chunker, start.return_codec_frames):
                                yield out
                        if await decode.write(stages_pb2.Code2WavInput(end=stages_pb2.CodecEnd())):
                            await decode.close()
                    case stages_pb2.Code2WavOutput() as out if out.HasField("audio"):
                        audio = resume.audio_chunk(out.audio)
                        if audio is not None:
                            chunker.playing(time.monotonic())
                            decode.output()
                            yield stages_pb2.TalkerOutput(audio=audio)
                    case stages_pb2.Code2WavOutput() as out:
                        resume.finish()
                        outcome = "ok"
                        spans.count("migrations", decode.moves)
                        yield stages_pb2.TalkerOutput(final=stages_pb2.TalkerFinal(
                            finish_reason=finish_reason_to_proto(done.reason), codec_frames=done.frames,
                            audio_samples=out.final.audio_samples, migrations=decode.moves))
                        return
        except grpc.aio.AbortError:
            outcome = "error"
            raise
        except Exception as exc:  # a failed engine, code2wav or text stream: one status for the caller
            # A thinker that goes away can reach the reader as its stream's end (no text-finished mark) first.
            gone = context.cancelled() or (isinstance(exc, InvalidArgument) and exc.field == "finished")
            outcome = "diverged" if isinstance(exc, ReplayDiverged) else "cancelled" if gone else type(exc).__name__
            if isinstance(exc, ReplayDiverged):
                decode.diverged()
            await abort_for(context, exc)
        finally:
            spans.finish(outcome)
            let_end(reader)  # never cancelled mid-read (services/serving/streams.py); ends with the call
            decode.cancel()
            self.loop.abort(key)

    @staticmethod
    async def _send_chunk(decode: Downstream, chunk: torch.Tensor, chunker: FrameChunker, return_frames: bool):
        message = frames_to_proto(chunk, first_frame=chunker.sent - chunk.shape[0])
        await decode.write(stages_pb2.Code2WavInput(frames=message))
        if return_frames:
            yield stages_pb2.TalkerOutput(codec_frames=message)

    async def _read_text(self, key: str, request_iterator, sink: EventSink) -> None:
        try:
            async for message in request_iterator:
                item = self.adapter.input_from_proto(message)
                self.loop.add_input(key, item)
                if isinstance(item, TextEnd):
                    return
            raise InvalidArgument("finished", "stream closed before the text-finished mark")
        except (InvalidArgument, WireError) as exc:
            sink.fail(exc)
        except grpc.aio.AioRpcError:
            pass

    async def GetLoad(self, request, context):
        return self.loop.load_report("talker", self.config.engine.num_slots, self.handle.draining, self.limits,
                                     reset_peak=request.reset_peak)

    @property
    def limits(self) -> common_pb2.StageLimits:
        """The talker's own limits; the thinker learns them from here (one owner per setting)."""
        return common_pb2.StageLimits(max_model_len=self.config.engine.max_model_len,
                                      max_new_tokens_limit=self.config.max_new_tokens_limit,
                                      default_max_new_tokens=self.config.default_max_new_tokens,
                                      text_rows_to_first_chunk=self.adapter.text_rows_to_first_chunk(self.config.chunks))


async def create_server(config: TalkerConfig) -> tuple[ServerHandle, EngineLoop]:
    family = family_of(config.model.checkpoint)
    adapter_cls, engine_config = ADAPTERS[family], config.engine
    if engine_config.graphs.enabled and not adapter_cls.cuda_graphs:
        log.warning("CUDA graphs are not implemented for the %s talker: decoding eagerly", family.value)
        engine_config = dataclasses.replace(engine_config, graphs=GraphSettings())
    loaded = load_for_serving(config.model, Stage.TALKER)
    engine = adapter_cls.engine(loaded.model, loaded.config, device=config.model.device, engine_config=engine_config)
    metrics = StageMetrics("talker")
    metrics.cache_capacity.set(config.engine.num_slots)
    metrics.serve(config.serving.metrics_port)
    loop = EngineLoop(engine, "talker", metrics)
    loop.start()
    handle = build_server(config.serving.host, config.serving.port, (SERVICE,), config.serving.max_message_bytes,
                          tls=config.serving.tls, health_port=config.serving.health_port)
    loop.streams = handle.streams  # LoadReport.in_flight counts open streams
    servicer = TalkerServicer(loop, engine, config, adapter_cls(loaded.config, config), handle)
    stages_pb2_grpc.add_TalkerServicer_to_server(servicer, handle.server)
    return handle, loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-talker", description=__doc__)
    add_model_flags(parser)
    add_serving_flags(parser, default_port=50062)
    add_engine_flags(parser)
    parser.add_argument("--first-chunk-frames", type=int, default=env_default("first_chunk_frames", 4),
                        help="frames in the first chunk sent to code2wav: time to first audio (default 4)")
    parser.add_argument("--chunk-frames", type=int, default=env_default("chunk_frames", 25),
                        help="frames per chunk once grown (default 25)")
    parser.add_argument("--chunk-growth", type=int, default=env_default("chunk_growth", 2),
                        help="each chunk this many times the previous, up to --chunk-frames; 1 = straight "
                             "from the first chunk to --chunk-frames (default 2: 4, 8, 16, 25, ...)")
    parser.add_argument("--delivery-ms", type=float, default=env_default("delivery_ms", 100.0),
                        help="how long a chunk takes from here to the listener (code2wav and the hops up): a chunk "
                             "goes out before it is full when waiting for the next frame would make it arrive "
                             "after the audio already sent has played (Qwen3-Omni; 0 = never; default 100)")
    parser.add_argument("--default-max-new-tokens", type=int, default=env_default("talker_default_max_new_tokens", 2048))
    parser.add_argument("--max-new-tokens-limit", type=int, default=env_default("talker_max_new_tokens_limit", 8192))
    args = parser.parse_args(argv)

    def run() -> None:
        try:
            chunks = ChunkPolicy(args.first_chunk_frames, args.chunk_frames, args.chunk_growth, args.delivery_ms)
        except ValueError as exc:
            raise UserError(f"--first-chunk-frames, --chunk-frames, --chunk-growth, --delivery-ms: {exc}") from None
        model = model_config_from_args(args)
        engine = TalkerEngineConfig(max_batch_size=args.max_batch_size, num_slots=args.num_slots,
                                    max_prefills_per_step=args.max_prefills_per_step,
                                    max_model_len=args.max_model_len, exact_batching=exact_batching(args),
                                    exact_gemm=exact_gemm(args),
                                    graphs=model.graphs)
        config = TalkerConfig(
            serving=serving_config_from_args(args), model=model, engine=engine,
            chunks=chunks,
            default_max_new_tokens=args.default_max_new_tokens, max_new_tokens_limit=args.max_new_tokens_limit,
        )
        serve_stage("talker", create_server, config, args.port_file)

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
