"""Talker gRPC service: hidden-state chunks in from the thinker, codec frames out to code2wav,
audio passed back up the same stream."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from contextlib import aclosing

import grpc

from omni.v1 import common_pb2, stages_pb2, stages_pb2_grpc
from services.base.env import env_default
from services.base.errors import UserError, run_cli
from services.base.families import Family, family_of
from services.runtime.chunking import ChunkPolicy
from services.runtime.model.checkpoint import Stage, load_for_serving
from services.runtime.model.settings import (
    GraphSettings,
    add_engine_flags,
    add_model_flags,
    add_prefix_cache_flag,
    check_engine_flags,
    model_config_from_args,
)
from services.serving.channels import ChannelPool
from services.serving.config import add_serving_flags, serving_config_from_args
from services.serving.engine_loop import EngineLoop
from services.serving.grpc_server import ServerHandle
from services.serving.metrics import StageMetrics
from services.serving.stage_main import serve_stage, start_stage
from services.talker.adapter import TalkerAdapter
from services.talker.config import TalkerConfig
from services.talker.engine_base import TalkerEngineConfig
from services.talker.qwen2_5_adapter import Qwen2_5TalkerAdapter
from services.talker.qwen3_adapter import Qwen3TalkerAdapter
from services.talker.stream import TalkerStream

log = logging.getLogger(Stage.TALKER)
SERVICE = stages_pb2.DESCRIPTOR.services_by_name["Talker"].full_name


# family -> its adapter (adapter.py), picked once at start by the checkpoint's model_type
ADAPTERS = {Family.QWEN3_OMNI: Qwen3TalkerAdapter, Family.QWEN2_5_OMNI: Qwen2_5TalkerAdapter}


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
        async with aclosing(TalkerStream(self, request_iterator, context).run()) as responses:
            async for response in responses:
                yield response

    async def GetLoad(self, request, context):
        return self.loop.load_report(Stage.TALKER, self.config.engine.num_slots, self.handle.draining, self.limits,
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
    handle, loop = start_stage(Stage.TALKER, engine, config.serving, SERVICE, cache_slots=config.engine.num_slots)
    servicer = TalkerServicer(loop, engine, config, adapter_cls(loaded.config, config), handle)
    stages_pb2_grpc.add_TalkerServicer_to_server(servicer, handle.server)
    if engine.prefix_pool is not None and loop.metrics is not None:
        loop.metrics.prefix_cache(engine.prefix_pool)
    return handle, loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-talker", description=__doc__)
    add_model_flags(parser)
    add_serving_flags(parser, default_port=50062)
    add_engine_flags(parser)
    add_prefix_cache_flag(parser, "Qwen3-Omni's talker keeps the KV of its prompt's blocks across requests (a "
                                  "conversation's earlier user turns)")
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
        check_engine_flags(args)
        model = model_config_from_args(args)
        config = TalkerConfig(
            serving=serving_config_from_args(args), model=model, engine=TalkerEngineConfig.from_args(args, model),
            chunks=chunks,
            default_max_new_tokens=args.default_max_new_tokens, max_new_tokens_limit=args.max_new_tokens_limit,
        )
        serve_stage(Stage.TALKER, create_server, config, args.port_file)

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
