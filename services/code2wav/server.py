"""Code2Wav gRPC service: codec frames in, PCM chunks out, on one bidirectional stream.

The family's adapter (adapter.py, picked once at start by the checkpoint's model_type) builds the
engine and converts the stream's messages; each stream is one `Code2WavStream`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from contextlib import aclosing

import grpc

from omni.v1 import stages_pb2, stages_pb2_grpc
from services.base.env import env_default
from services.base.errors import InvalidArgument, UserError, run_cli
from services.base.families import Family
from services.base.stages import Stage
from services.code2wav.adapter import Code2WavAdapter
from services.code2wav.blocks import BlockGrid
from services.code2wav.config import Code2WavConfig, Decoder
from services.code2wav.qwen2_5_adapter import Qwen2_5Code2WavAdapter
from services.code2wav.qwen3_adapter import Qwen3Code2WavAdapter
from services.code2wav.stream import Code2WavStream
from services.code2wav.token2wav import StreamContext, Token2WavGeometry
from services.code2wav.vocoder import VocoderGeometry
from services.runtime.chunking import DEFAULT_CHUNKS
from services.runtime.model.checkpoint import LoadedStage, load_for_serving
from services.runtime.model.settings import EXACT_CHOICES, add_model_flags, exact_batching, model_config_from_args, parse_buckets
from services.serving.config import (
    add_serving_flags,
    serving_config_from_args,
)
from services.serving.engine_loop import (
    EngineLoop,
)
from services.serving.grpc_server import ServerHandle
from services.serving.stage_main import serve_stage, start_stage
from services.serving.status import abort_for

log = logging.getLogger(Stage.CODE2WAV)
SERVICE = stages_pb2.DESCRIPTOR.services_by_name["Code2Wav"].full_name

# family -> its adapter (adapter.py), picked once at start by the checkpoint's model_type
ADAPTERS = {Family.QWEN3_OMNI: Qwen3Code2WavAdapter, Family.QWEN2_5_OMNI: Qwen2_5Code2WavAdapter}


def adapter_for(loaded: LoadedStage, config: Code2WavConfig) -> Code2WavAdapter:
    return ADAPTERS[loaded.family](loaded, config)


class Code2WavServicer(stages_pb2_grpc.Code2WavServicer):
    def __init__(self, loop: EngineLoop, adapter: Code2WavAdapter, geometry: VocoderGeometry | Token2WavGeometry,
                 handle: ServerHandle, idle_timeout_s: float):
        self.loop = loop
        self.adapter = adapter  # the family's: start message -> engine job, frames -> engine input
        self.geometry = geometry  # the engine's: samples_per_frame, sample_rate
        self.handle = handle
        self.idle_timeout_s = idle_timeout_s

    async def Decode(self, request_iterator, context: grpc.aio.ServicerContext):
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("start"):
            await abort_for(context, InvalidArgument("start", "the first message must be start"))
        call = Code2WavStream(self, first.start.request_id or "anonymous", context)
        # (closed here when grpc closes this handler: its `finally`, the trace's outcome included,
        # runs before the server span ends, not later when the generator is collected)
        async with aclosing(call.run(first.start, request_iterator)) as outputs:
            async for output in outputs:
                yield output

    async def GetLoad(self, request, context):
        return self.loop.load_report(Stage.CODE2WAV, 0, self.handle.draining, reset_peak=request.reset_peak)


async def create_server(config: Code2WavConfig) -> tuple[ServerHandle, EngineLoop]:
    loaded = load_for_serving(config.model, Stage.CODE2WAV)
    adapter = adapter_for(loaded, config)
    engine = adapter.build_engine()
    handle, loop = start_stage(Stage.CODE2WAV, engine, config.serving, SERVICE)
    servicer = Code2WavServicer(loop, adapter, engine.geometry, handle, config.serving.stream_idle_timeout_s)
    stages_pb2_grpc.add_Code2WavServicer_to_server(servicer, handle.server)
    return handle, loop


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-code2wav", description=__doc__)
    add_model_flags(parser)
    add_serving_flags(parser, default_port=50063)
    parser.add_argument("--decoder", choices=list(Decoder), default=env_default("decoder", Decoder.INCREMENTAL.value),
                        help="incremental (default): the vocoder's transformer and convolutions keep their state "
                             "per request, exact for any checkpoint; window: re-decode --left-context frames before "
                             "each block (exact only for short-reach vocoders such as the tiny checkpoint's)")
    parser.add_argument("--block-frames", default=env_default("block_frames", ""),
                        help="the block grid, sizes in frames, the last repeating: every vocoder call decodes a "
                             "whole block at a fixed place in the stream, so the audio does not depend on how the "
                             "talker cut it (default: the talker's default chunk schedule, 4,8,16,25; set it to the "
                             "talker's schedule when its chunk flags differ; exact mode decodes a block only once whole "
                             "until its start-up check finds an open block keeps its frames' bits)")
    parser.add_argument("--max-batch", type=int, default=env_default("max_batch", -1),
                        help="most requests' blocks decoded in one call (exact mode: the batch sizes the start-up "
                             "probe finds bit-identical to each request alone; default 64 on cuda, where a call is "
                             "a replayed CUDA graph, 16 elsewhere; 1 = never batch)")
    parser.add_argument("--max-batch-frames", type=int, default=env_default("max_batch_frames", -1),
                        help="most frames one call decodes over its whole batch (default: 64 on cpu, where larger "
                             "calls are slower a frame; no bound on cuda; 0 = no bound)")
    parser.add_argument("--left-context", type=int, default=env_default("left_context", 25),
                        help="window decoder: frames of left context decoded before each block (default 25)")
    parser.add_argument("--delivery-ms", type=float, default=env_default("delivery_ms", 100.0),
                        help="how long audio takes from here to the listener; a running request's next block is "
                             "decoded first once its listener's audio runs out within this (default 100)")
    parser.add_argument("--graph-windows", default=env_default("graph_windows", ""),
                        help="window decoder: window lengths (context + block frames) captured as CUDA graphs at "
                             "start-up; others are captured on first use (default: every length of the block grid)")
    parser.add_argument("--token2wav-context", default=env_default("token2wav_context", ""),
                        help="Qwen2.5-Omni only: LEFT:AHEAD[:CHUNK[:VOCODER]] codec tokens of context around each "
                             "streamed chunk (default 96:48:24:32: 109 dB against one whole Token2Wav call on the tiny "
                             "checkpoint, where 48:24 gives 69 dB; "
                             "docs/qwen2_5-omni-token2wav.md has the trade-off table)")
    parser.add_argument("--exact-batching", choices=EXACT_CHOICES, default=env_default("exact_batching", "auto"),
                        help="on: every request's audio is bit-identical whatever else decodes (a migrated "
                             "request's replay needs it): Qwen3-Omni's block size and batch sizes are checked at "
                             "start-up, Qwen2.5-Omni's Token2Wav decodes every window alone; off batches without a "
                             "probe (auto: on for cpu, off for cuda; gemm: on)")
    return parser


def config_from_args(args: argparse.Namespace) -> Code2WavConfig:
    try:
        context = StreamContext.parse(args.token2wav_context) if args.token2wav_context else StreamContext()
    except ValueError as exc:
        raise UserError(f"--token2wav-context: {exc}") from None
    if args.delivery_ms < 0:
        raise UserError(f"--delivery-ms must be >= 0, got {args.delivery_ms}")
    if args.max_batch < 1 and args.max_batch != -1:
        raise UserError(f"--max-batch must be at least 1, got {args.max_batch}")
    cuda = str(args.device).startswith("cuda")
    max_batch = args.max_batch if args.max_batch != -1 else (64 if cuda else 16)
    max_batch_frames = args.max_batch_frames if args.max_batch_frames >= 0 else (0 if cuda else 64)
    try:
        blocks = BlockGrid(tuple(int(x) for x in args.block_frames.split(","))) if args.block_frames else BlockGrid(
            DEFAULT_CHUNKS.schedule())
    except ValueError as exc:
        raise UserError(f"--block-frames {args.block_frames!r}: comma-separated frame counts >= 1, e.g. 4,8,16,25 "
                        f"({exc})") from None
    windows = parse_buckets(args.graph_windows, "--graph-windows") if args.graph_windows else ()
    return Code2WavConfig(serving=serving_config_from_args(args), model=model_config_from_args(args),
                          left_context=args.left_context, decoder=Decoder(args.decoder), blocks=blocks,
                          max_batch=max_batch, max_batch_frames=max_batch_frames, graph_windows=windows,
                          delivery_ms=args.delivery_ms, token2wav_context=context, exact=exact_batching(args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(lambda: serve_stage(Stage.CODE2WAV, create_server, config_from_args(args), args.port_file))


if __name__ == "__main__":
    sys.exit(main())
