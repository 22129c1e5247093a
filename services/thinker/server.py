"""Thinker gRPC service: streams text deltas to its caller and, when audio is wanted, streams
hidden states to the talker named in the route, passing the audio that comes back up."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from contextlib import aclosing

import grpc

from omni.v1 import common_pb2, stages_pb2, stages_pb2_grpc
from services.base.env import env_default
from services.base.errors import run_cli
from services.base.families import Family, family_of
from services.runtime.inputs.prompt import (
    PromptBuilder,
    PromptLimits,
)
from services.runtime.inputs.video import VideoLimits
from services.runtime.model.checkpoint import Stage, load_for_serving
from services.runtime.model.settings import (
    GraphSettings,
    add_engine_flags,
    add_model_flags,
    add_prefix_cache_flag,
    check_engine_flags,
    model_config_from_args,
    on_unless_cuda,
)
from services.serving.channels import ChannelPool
from services.serving.config import add_serving_flags, serving_config_from_args
from services.serving.engine_loop import EngineLoop
from services.serving.grpc_server import ServerHandle
from services.serving.metrics import StageMetrics
from services.serving.open_streams import LIGHT_LOAD_STREAMS
from services.serving.peer_limits import PeerLimits
from services.serving.stage_main import serve_stage, start_stage
from services.thinker.adapter import ThinkerAdapter
from services.thinker.admission import Admission
from services.thinker.config import Backend, ThinkerConfig
from services.thinker.engine import HoldText, ThinkerEngine, ThinkerEngineConfig
from services.thinker.qwen2_5_adapter import Qwen2_5ThinkerAdapter
from services.thinker.qwen3_adapter import Qwen3ThinkerAdapter
from services.thinker.stream import ThinkerStream

log = logging.getLogger(Stage.THINKER)
SERVICE = stages_pb2.DESCRIPTOR.services_by_name["Thinker"].full_name



# Audio first (ThinkerConfig.audio_first): a spoken request's text is held at the talker's first
# chunk plus this many tokens until the talker answers, for at most AUDIO_FIRST_HOLD_S, when it
# arrives with at most LIGHT_LOAD_STREAMS streams open here (itself included). Under more load
# the stages are busy anyway and holds only move text work around (measured at 16: TTFP p50 +10 %).
AUDIO_FIRST_MARGIN = 4
# Off: an item encoded alone differs from generate's one call over a prompt's items in the last bits
# (services/thinker/encoder_cache.py). 256 MiB holds about 80 minutes of Qwen3-Omni audio.
DEFAULT_ENCODER_CACHE_MB = 0
AUDIO_FIRST_HOLD_S = 1.0


# family -> its adapter (adapter.py), picked once at start by the checkpoint's model_type
ADAPTERS = {Family.QWEN3_OMNI: Qwen3ThinkerAdapter, Family.QWEN2_5_OMNI: Qwen2_5ThinkerAdapter}


class ThinkerServicer(stages_pb2_grpc.ThinkerServicer):
    def __init__(self, loop: EngineLoop, engine: ThinkerEngine, prompts: PromptBuilder, config: ThinkerConfig,
                 handle: ServerHandle, adapter: ThinkerAdapter, build_prompt=PromptBuilder.build):
        self.loop = loop
        self.adapter = adapter  # the family's: voices, job, talker prompt length, talker-bound messages
        self.handle = handle
        self.engine = engine
        self.prompts = prompts
        self.config = config
        self.channels = ChannelPool(config.serving.max_message_bytes, config.serving.tls)
        self.talker_limits = PeerLimits(Stage.TALKER, self.channels)
        self.metrics: StageMetrics = loop.metrics
        self.prefix_pool = getattr(engine, "prefix_pool", None)  # the transformers engine's, when on
        self.admission = Admission(adapter, prompts, config, build_prompt, caches_prefixes=self.prefix_pool is not None)

    async def Generate(self, request: stages_pb2.ThinkerRequest, context: grpc.aio.ServicerContext):
        async with aclosing(ThinkerStream(self, request, context).run()) as responses:
            async for response in responses:
                yield response

    def hold_text(self, key: str, talker: common_pb2.StageLimits) -> bool:
        """Audio first: hold the request's text at what the talker's first chunk needs plus a
        margin, until the talker answers (services/thinker/engine.py), when the stage is lightly
        loaded; True when held."""
        rows = talker.text_rows_to_first_chunk if talker.HasField("text_rows_to_first_chunk") else None
        if (not self.config.audio_first or not rows or not isinstance(self.engine, ThinkerEngine)
                or self.loop.in_flight > LIGHT_LOAD_STREAMS):
            return False
        self.loop.add_input(key, HoldText(rows + AUDIO_FIRST_MARGIN, AUDIO_FIRST_HOLD_S))
        return True

    async def GetLoad(self, request, context):
        report = self.loop.load_report(Stage.THINKER, self.config.engine.num_slots, self.handle.draining,
                                       reset_peak=request.reset_peak)
        report.tools = self.admission.tools_refused is None
        if self.prefix_pool is not None:
            epoch, seq, full, held = self.prefix_pool.index.report(request.prefix_epoch, request.prefix_since)
            report.prefix.CopyFrom(common_pb2.PrefixReport(
                epoch=epoch, seq=seq, full=full, held=[common_pb2.PrefixHeld(key=k, tokens=t) for k, t in held]))
        return report


async def create_server(config: ThinkerConfig) -> tuple[ServerHandle, EngineLoop]:
    build_prompt = PromptBuilder.build
    if config.backend is Backend.VLLM:
        from services.thinker import vllm_backend

        engine = vllm_backend.VllmThinkerEngine(vllm_backend.VllmThinkerConfig(
            checkpoint=config.model.checkpoint, dtype=config.model.dtype, max_num_seqs=config.engine.max_batch_size,
            max_model_len=config.engine.max_model_len, talker_inputs_device=config.model.device,
            kv_cache_bytes=config.vllm_kv_cache_bytes, gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            enable_prefix_caching=config.engine.prefix_cache_mb != 0,
        ))
        model_config, build_prompt = engine.config, vllm_backend.build_prompt
    else:
        family = family_of(config.model.checkpoint)
        engine_config, engine_cls = config.engine, ADAPTERS[family].engine
        if engine_config.graphs.enabled and not ADAPTERS[family].cuda_graphs:
            log.warning("CUDA graphs are not implemented for the %s thinker: decoding eagerly", family.value)
            engine_config = dataclasses.replace(engine_config, graphs=GraphSettings())
        loaded = load_for_serving(config.model, Stage.THINKER)
        engine = engine_cls(loaded.model, loaded.config, device=config.model.device, engine_config=engine_config)
        model_config = loaded.config
    prompts = PromptBuilder(config.model.checkpoint, model_config, config.limits)
    prompts.feature_cache = getattr(engine, "encoder_cache", None)  # on: each clip's features kept too
    adapter = ADAPTERS[Family(model_config.model_type)](config.model.checkpoint, model_config, prompts)
    handle, loop = start_stage(Stage.THINKER, engine, config.serving, SERVICE, cache_slots=config.engine.num_slots)
    servicer = ThinkerServicer(loop, engine, prompts, config, handle, adapter, build_prompt)
    if servicer.prefix_pool is not None and loop.metrics is not None:
        loop.metrics.prefix_cache(servicer.prefix_pool)
    if getattr(engine, "encoder_cache", None) is not None and loop.metrics is not None:  # on, transformers
        loop.metrics.encoder_cache(engine.encoder_cache)
    stages_pb2_grpc.add_ThinkerServicer_to_server(servicer, handle.server)
    return handle, loop


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-thinker", description=__doc__)
    add_model_flags(parser)
    add_serving_flags(parser, default_port=50061)
    add_engine_flags(parser)
    parser.add_argument("--default-max-new-tokens", type=int, default=env_default("thinker_default_max_new_tokens", 512))
    parser.add_argument("--max-new-tokens-limit", type=int, default=env_default("thinker_max_new_tokens_limit", 4096))
    parser.add_argument("--backend", choices=list(Backend), type=Backend,
                        default=env_default("thinker_backend", Backend.TRANSFORMERS),
                        help="thinker engine: transformers (default) or vllm (make setup-vllm)")
    parser.add_argument("--vllm-kv-cache-mb", type=int, default=env_default("vllm_kv_cache_mb", 0),
                        help="vLLM backend: KV cache size (default: 512 on cpu, where vLLM would otherwise "
                             "reserve 90%% of the host's memory; on cuda vLLM sizes it from --vllm-gpu-memory-utilization)")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float,
                        default=env_default("vllm_gpu_memory_utilization", 0.9),
                        help="vLLM backend: fraction of GPU memory vLLM may take (default 0.9)")
    add_prefix_cache_flag(parser, "the thinker keeps prompt KV blocks across requests, so a conversation's turn "
                                  "prefills only its new part; the vLLM backend uses vLLM's own")
    parser.add_argument("--encoder-cache-mb", type=int, default=env_default("encoder_cache_mb", DEFAULT_ENCODER_CACHE_MB),
                        help="the audio, image and video encoders' outputs kept by content hash, so a turn that "
                             "re-sends earlier media encodes only its new items; each item is then encoded alone, "
                             "which differs from generate's one call over several items in the last bits "
                             "(default 0 = off; 256 holds about 80 minutes of audio; the transformers backend)")
    parser.add_argument("--audio-first", choices=["auto", "on", "off"], default=env_default("audio_first", "auto"),
                        help="hold a spoken request's text at the talker's first chunk + 4 tokens until the talker "
                             "answers, so text nobody hears yet does not slow the first audio where the stages "
                             "share cores (auto: on for cpu)")
    add_input_limit_flags(parser)
    return parser


def add_input_limit_flags(parser: argparse.ArgumentParser) -> None:
    """The per-request input limits (docs/security.md), checked before anything is decoded."""
    parser.add_argument("--max-prompt-tokens", type=int, default=env_default("max_prompt_tokens", 0),
                        help="longest prompt in tokens (default: the model's maximum)")
    parser.add_argument("--max-audio-seconds", type=float, default=env_default("max_audio_seconds", 300.0),
                        help="longest audio input part (default 300 s)")
    parser.add_argument("--max-image-pixels", type=int, default=env_default("max_image_pixels", 4096 * 4096),
                        help="largest image input part in pixels (default 4096x4096)")
    parser.add_argument("--max-video-seconds", type=float, default=env_default("max_video_seconds", 600.0),
                        help="longest video input part, as its container declares (default 600 s)")
    parser.add_argument("--max-video-frames", type=int, default=env_default("max_video_frames", 36_000),
                        help="most frames a video part may declare (default 36000: every one up to the last "
                             "sampled frame is decoded)")
    parser.add_argument("--max-video-pixels", type=int, default=env_default("max_video_pixels", 3840 * 2160),
                        help="largest video frame in pixels, as declared (default 3840x2160)")
    parser.add_argument("--video-fps", type=float, default=env_default("video_fps", 2.0),
                        help="frames sampled per second of video (default 2, Qwen's)")


def config_from_args(args: argparse.Namespace) -> ThinkerConfig:
    check_engine_flags(args)
    model = model_config_from_args(args)
    engine = ThinkerEngineConfig.from_args(args, model)
    limits = PromptLimits(args.max_prompt_tokens or None, args.max_audio_seconds, args.max_image_pixels,
                          VideoLimits(args.max_video_seconds, args.max_video_frames, args.max_video_pixels),
                          args.video_fps)
    return ThinkerConfig(
        serving=serving_config_from_args(args), model=model, engine=engine,
        default_max_new_tokens=args.default_max_new_tokens, max_new_tokens_limit=args.max_new_tokens_limit,
        limits=limits, backend=Backend(args.backend),
        vllm_kv_cache_bytes=(args.vllm_kv_cache_mb or (512 if args.device == "cpu" else 0)) << 20 or None,
        vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        audio_first=on_unless_cuda(args.audio_first, args.device))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(lambda: serve_stage(Stage.THINKER, create_server, config_from_args(args), args.port_file))


if __name__ == "__main__":
    sys.exit(main())
