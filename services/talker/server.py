"""Talker gRPC service: hidden-state chunks in from the thinker, codec frames out to code2wav,
audio passed back up the same stream."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from dataclasses import dataclass

import grpc
import torch

from omni.v1 import common_pb2, stages_pb2, stages_pb2_grpc
from services.runtime import qwen2_5_omni
from services.runtime.checkpoint import Stage, load_for_serving
from services.runtime.chunking import DEFAULT_CHUNKS, ChunkPolicy, FrameChunker
from services.runtime.errors import InvalidArgument, run_cli
from services.runtime.families import Family, family_of
from services.runtime.prompt import resolve_voice
from services.runtime.qwen3_omni import talker_prompt_len
from services.runtime.settings import (
    GraphSettings,
    ModelConfig,
    add_engine_flags,
    add_model_flags,
    env_default,
    exact_batching,
    model_config_from_args,
)
from services.serving.channels import ChannelPool
from services.serving.config import (
    ServingConfig,
    add_serving_flags,
    serving_config_from_args,
)
from services.serving.convert import finish_reason_to_proto, sampling_from_proto
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
from services.serving.wire import frames_to_proto, tensor_from_proto
from services.talker.engine import (
    Frame,
    TalkerDone,
    TalkerEngine,
    TalkerEngineConfig,
    TalkerJob,
    TextEnd,
    TextRow,
)
from services.talker.qwen2_5 import Qwen2_5TalkerEngine, Qwen2_5TalkerJob, ReplyPart

log = logging.getLogger("talker")
SERVICE = stages_pb2.DESCRIPTOR.services_by_name["Talker"].full_name


@dataclass(frozen=True)
class TalkerConfig:
    serving: ServingConfig
    model: ModelConfig
    engine: TalkerEngineConfig = TalkerEngineConfig()
    chunks: ChunkPolicy = DEFAULT_CHUNKS  # how frames are cut into chunks for code2wav
    default_max_new_tokens: int = 2048
    max_new_tokens_limit: int = 8192


def talker_job_from_proto(start: stages_pb2.TalkerStart, model_config, config: TalkerConfig) -> TalkerJob:
    """Validate and convert the start message (fields named as in the proto)."""
    hidden = model_config.thinker_config.text_config.hidden_size
    _, speaker_id = resolve_voice(model_config, start.voice or None)
    embeds = tensor_from_proto(start.prompt_embeds)
    if embeds.ndim != 2 or embeds.shape[1] != hidden or embeds.shape[0] != len(start.prompt_token_ids):
        raise InvalidArgument("start.prompt_embeds", f"must be [{len(start.prompt_token_ids)}, {hidden}], "
                                                     f"got {list(embeds.shape)}")
    positions = list(start.multimodal_positions)
    mm_hidden = (tensor_from_proto(start.multimodal_hidden) if start.HasField("multimodal_hidden")
                 else torch.zeros((0, hidden)))
    if mm_hidden.shape != (len(positions), hidden) or any(not 0 <= p < embeds.shape[0] for p in positions):
        raise InvalidArgument("start.multimodal_hidden", "must have one row per multimodal position inside the prompt")
    tts = tensor_from_proto(start.tts_embeds)
    if tts.shape != (3, hidden):
        raise InvalidArgument("start.tts_embeds", f"must be [3, {hidden}], got {list(tts.shape)}")
    sampling = sampling_from_proto(start.sampling, "talker_sampling", config.default_max_new_tokens,
                                   config.max_new_tokens_limit, default_repetition_penalty=1.05)
    needed = talker_prompt_len(list(start.prompt_token_ids), model_config) + sampling.max_new_tokens
    if needed > config.engine.max_model_len:
        raise InvalidArgument("talker_sampling.max_new_tokens",
                              f"talker prompt + max_new_tokens ({needed}) exceeds the talker's per-request cache "
                              f"({config.engine.max_model_len})")
    return TalkerJob(
        prompt_token_ids=list(start.prompt_token_ids), prompt_embeds=embeds, multimodal_positions=positions,
        multimodal_hidden=mm_hidden, tts_embeds=tts, speaker_id=speaker_id,
        sampling=sampling,
        image_grid_thw=tensor_from_proto(start.image_grid_thw) if start.HasField("image_grid_thw") else None,
        audio_feature_lengths=(tensor_from_proto(start.audio_feature_lengths)
                               if start.HasField("audio_feature_lengths") else None),
    )


def qwen2_5_job_from_proto(start: stages_pb2.TalkerStart, model_config, config: TalkerConfig) -> Qwen2_5TalkerJob:
    """Validate and convert Qwen2.5-Omni's start message (fields named as in the proto)."""
    hidden = model_config.thinker_config.text_config.hidden_size
    prompt_len = len(start.prompt_token_ids)
    if not start.HasField("prompt_hidden") or not start.HasField("text_embeds"):
        raise InvalidArgument("start.prompt_hidden", "Qwen2.5-Omni's talker needs prompt_hidden and text_embeds")
    prompt_hidden = tensor_from_proto(start.prompt_hidden)
    if prompt_hidden.shape != (prompt_len, hidden) or not prompt_hidden.is_floating_point():
        raise InvalidArgument("start.prompt_hidden", f"must be [{prompt_len}, {hidden}] floats, "
                                                     f"got {list(prompt_hidden.shape)} {prompt_hidden.dtype}")
    text_embeds = tensor_from_proto(start.text_embeds)
    if text_embeds.shape != (3, hidden) or not text_embeds.is_floating_point():
        raise InvalidArgument("start.text_embeds", f"must be [3, {hidden}] floats, got {list(text_embeds.shape)}")
    sampling = sampling_from_proto(start.sampling, "talker_sampling", config.default_max_new_tokens,
                                   config.max_new_tokens_limit, default_repetition_penalty=1.05)
    needed = qwen2_5_omni.talker_prompt_len(prompt_len) + sampling.max_new_tokens
    if needed > config.engine.max_model_len:
        raise InvalidArgument("talker_sampling.max_new_tokens",
                              f"talker prompt + max_new_tokens ({needed}) exceeds the talker's per-request cache "
                              f"({config.engine.max_model_len})")
    return Qwen2_5TalkerJob(prompt_hidden=prompt_hidden, text_embeds=text_embeds, sampling=sampling)


def qwen2_5_input_from_proto(message: stages_pb2.TalkerInput, hidden: int) -> ReplyPart | TextEnd:
    """A Qwen2.5-Omni talker input after start: a token's reply part, or the text's end."""
    if message.HasField("finished"):
        return TextEnd()
    if not message.HasField("token") or not message.token.HasField("reply"):
        raise InvalidArgument("token.reply", "expected a token with its reply part, or finished")
    reply = tensor_from_proto(message.token.reply)
    if reply.shape != (hidden,) or not reply.is_floating_point():
        raise InvalidArgument("token.reply", f"must be [{hidden}] floats, got {list(reply.shape)} {reply.dtype}")
    return ReplyPart(reply)


class TalkerServicer(stages_pb2_grpc.TalkerServicer):
    def __init__(self, loop: EngineLoop, engine: TalkerEngine, config: TalkerConfig, model_config,
                 handle: ServerHandle):
        self.loop = loop
        self.handle = handle
        self.engine = engine
        self.config = config
        self.model_config = model_config
        self.channels = ChannelPool(config.serving.max_message_bytes, config.serving.tls)
        self.metrics: StageMetrics = loop.metrics
        self.family = Family(model_config.model_type)

    def job_from_proto(self, start: stages_pb2.TalkerStart):
        if self.family is Family.QWEN2_5_OMNI:
            return qwen2_5_job_from_proto(start, self.model_config, self.config)
        return talker_job_from_proto(start, self.model_config, self.config)

    def input_from_proto(self, message: stages_pb2.TalkerInput):
        """A text input after start: the family's text row, or the text's end (TextEnd)."""
        if self.family is Family.QWEN2_5_OMNI:
            return qwen2_5_input_from_proto(message, self.model_config.thinker_config.text_config.hidden_size)
        if message.HasField("token"):
            return TextRow(tensor_from_proto(message.token.embedding))
        if message.HasField("finished"):
            return TextEnd()
        raise InvalidArgument("event", "expected token or finished after start")

    async def Speak(self, request_iterator, context: grpc.aio.ServicerContext):
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("start"):
            await abort_for(context, InvalidArgument("start", "the first message must be start"))
        start = first.start
        try:
            job = self.job_from_proto(start)
        except (InvalidArgument, WireError) as exc:
            await abort_for(context, exc)
        if not start.route.code2wav:
            await abort_for(context, InvalidArgument("route.code2wav", "no code2wav replica given"))
        request_id = start.request_id or "anonymous"
        key = engine_key(request_id)  # unique per stream, whatever ids callers reuse
        sink = EventSink(asyncio.get_running_loop())
        self.loop.add(key, job, sink)
        reader = asyncio.create_task(self._read_text(key, request_iterator, sink))
        route = start.route
        decode = Downstream(
            "talker", "code2wav", [route.code2wav, *route.code2wav_fallbacks],
            lambda address: stages_pb2_grpc.Code2WavStub(self.channels.get(address)).Decode(timeout=time_remaining(context)),
            sink, lambda out: out.HasField("final"), route.max_migrations, self.metrics,
            stall_timeout_s=self.config.serving.stall_timeout_s(stages_below=0))
        decode.open()
        resume = Resume("code2wav")  # what went up from code2wav, across moves
        chunker = FrameChunker(self.config.chunks)
        done: TalkerDone | None = None
        try:
            await decode.write(stages_pb2.Code2WavInput(start=stages_pb2.Code2WavStart(request_id=request_id)))
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
                        chunk = chunker.add(codes)
                        if chunk is not None:
                            async for out in self._send_chunk(decode, chunk, chunker, start.return_codec_frames):
                                yield out
                    case TalkerDone() as talker_done:
                        done = talker_done
                        chunk = chunker.flush()
                        if chunk is not None:
                            async for out in self._send_chunk(decode, chunk, chunker, start.return_codec_frames):
                                yield out
                        if await decode.write(stages_pb2.Code2WavInput(end=stages_pb2.CodecEnd())):
                            await decode.close()
                    case stages_pb2.Code2WavOutput() as out if out.HasField("audio"):
                        audio = resume.audio_chunk(out.audio)
                        if audio is not None:
                            decode.output()
                            yield stages_pb2.TalkerOutput(audio=audio)
                    case stages_pb2.Code2WavOutput() as out:
                        resume.finish()
                        yield stages_pb2.TalkerOutput(final=stages_pb2.TalkerFinal(
                            finish_reason=finish_reason_to_proto(done.reason), codec_frames=done.frames,
                            audio_samples=out.final.audio_samples, migrations=decode.moves))
                        return
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a failed engine, code2wav or text stream: one status for the caller
            if isinstance(exc, ReplayDiverged):
                decode.diverged()
            await abort_for(context, exc)
        finally:
            reader.cancel()
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
                item = self.input_from_proto(message)
                self.loop.add_input(key, item)
                if isinstance(item, TextEnd):
                    return
            raise InvalidArgument("finished", "stream closed before the text-finished mark")
        except (InvalidArgument, WireError) as exc:
            sink.fail(exc)
        except grpc.aio.AioRpcError:
            pass

    async def GetLoad(self, request, context):
        return self.loop.load_report("talker", self.config.engine.num_slots, self.handle.draining, self.limits)

    @property
    def limits(self) -> common_pb2.StageLimits:
        """The talker's own limits; the thinker learns them from here (one owner per setting)."""
        return common_pb2.StageLimits(max_model_len=self.config.engine.max_model_len,
                                      max_new_tokens_limit=self.config.max_new_tokens_limit,
                                      default_max_new_tokens=self.config.default_max_new_tokens)


async def create_server(config: TalkerConfig) -> tuple[ServerHandle, EngineLoop]:
    engine_config, engine_cls = config.engine, TalkerEngine
    if family_of(config.model.checkpoint) is Family.QWEN2_5_OMNI:
        engine_cls = Qwen2_5TalkerEngine
        if engine_config.graphs.enabled:
            log.warning("CUDA graphs are not implemented for the Qwen2.5-Omni talker: decoding eagerly")
            engine_config = dataclasses.replace(engine_config, graphs=GraphSettings())
    loaded = load_for_serving(config.model, Stage.TALKER)
    engine = engine_cls(loaded.model, loaded.config, device=config.model.device, engine_config=engine_config)
    metrics = StageMetrics("talker")
    metrics.cache_capacity.set(config.engine.num_slots)
    metrics.serve(config.serving.metrics_port)
    loop = EngineLoop(engine, "talker", metrics)
    loop.start()
    handle = build_server(config.serving.host, config.serving.port, (SERVICE,), config.serving.max_message_bytes,
                          tls=config.serving.tls, health_port=config.serving.health_port)
    loop.streams = handle.streams  # LoadReport.in_flight counts open streams
    stages_pb2_grpc.add_TalkerServicer_to_server(TalkerServicer(loop, engine, config, loaded.config, handle), handle.server)
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
    parser.add_argument("--default-max-new-tokens", type=int, default=env_default("talker_default_max_new_tokens", 2048))
    parser.add_argument("--max-new-tokens-limit", type=int, default=env_default("talker_max_new_tokens_limit", 8192))
    args = parser.parse_args(argv)

    def run() -> None:
        model = model_config_from_args(args)
        engine = TalkerEngineConfig(max_batch_size=args.max_batch_size, num_slots=args.num_slots,
                                    max_prefills_per_step=args.max_prefills_per_step,
                                    max_model_len=args.max_model_len, exact_batching=exact_batching(args),
                                    graphs=model.graphs)
        config = TalkerConfig(
            serving=serving_config_from_args(args), model=model, engine=engine,
            chunks=ChunkPolicy(args.first_chunk_frames, args.chunk_frames, args.chunk_growth),
            default_max_new_tokens=args.default_max_new_tokens, max_new_tokens_limit=args.max_new_tokens_limit,
        )
        serve_stage("talker", create_server, config, args.port_file)

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
