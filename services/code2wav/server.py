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
from services.runtime.checkpoint import Stage, load_for_serving
from services.runtime.chunking import DEFAULT_CHUNKS
from services.runtime.errors import InvalidArgument, run_cli
from services.runtime.settings import (
    ModelConfig,
    add_model_flags,
    env_default,
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
from services.serving.wire import audio_to_proto, frames_from_proto

log = logging.getLogger("code2wav")
SERVICE = stages_pb2.DESCRIPTOR.services_by_name["Code2Wav"].full_name


@dataclass(frozen=True)
class Code2WavConfig:
    serving: ServingConfig
    model: ModelConfig
    left_context: int = 25  # --decoder window: frames of context decoded before each chunk
    decoder: str = "incremental"  # or "window" (see services/code2wav/engine.py)
    # Window lengths captured as CUDA graphs at start-up (others on first use): those of the
    # talker's default chunks (services/runtime/chunking.py) with `left_context` frames of context.
    graph_windows: tuple[int, ...] = DEFAULT_CHUNKS.windows(25)


class Code2WavServicer(stages_pb2_grpc.Code2WavServicer):
    def __init__(self, loop: EngineLoop, engine: Code2WavEngine, handle: ServerHandle, idle_timeout_s: float):
        self.loop = loop
        self.engine = engine
        self.handle = handle
        self.idle_timeout_s = idle_timeout_s
        self.sample_rate = engine.geometry.sample_rate

    async def Decode(self, request_iterator, context: grpc.aio.ServicerContext):
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("start"):
            await abort_for(context, InvalidArgument("start", "the first message must be start"))
        request_id = first.start.request_id or "anonymous"
        key = engine_key(request_id)  # unique per stream, whatever ids callers reuse
        sink = EventSink(asyncio.get_running_loop())
        self.loop.add(key, None, sink)
        reader = asyncio.create_task(self._read_inputs(key, request_iterator, sink))
        index = 0
        finished = False
        try:
            while True:
                match await sink.get(self.idle_timeout_s, "code2wav"):
                    case Audio() as audio:
                        yield stages_pb2.Code2WavOutput(audio=audio_to_proto(
                            audio.samples, self.sample_rate, index,
                            audio.first_sample // self.engine.geometry.samples_per_frame))
                        index += 1
                    case Decoded(samples=samples):
                        finished = True
                        yield stages_pb2.Code2WavOutput(final=stages_pb2.Code2WavFinal(audio_samples=samples))
                        return
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a failed engine or a bad input stream
            await abort_for(context, exc)
        finally:
            reader.cancel()
            if not finished:
                self.loop.abort(key)

    async def _read_inputs(self, key: str, request_iterator, sink: EventSink) -> None:
        try:
            async for message in request_iterator:
                if message.HasField("frames"):
                    frames = frames_from_proto(message.frames)
                    if frames.shape[1] != self.engine.num_quantizers:
                        raise InvalidArgument("frames.num_code_groups",
                                              f"must be {self.engine.num_quantizers}, got {frames.shape[1]}")
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
        return self.loop.load_report("code2wav", 0, self.handle.draining)


async def create_server(config: Code2WavConfig) -> tuple[ServerHandle, EngineLoop]:
    loaded = load_for_serving(config.model, Stage.CODE2WAV)
    engine = Code2WavEngine(loaded.model, loaded.config, left_context=config.left_context, decoder=config.decoder,
                            graphs=config.model.graphs, graph_windows=config.graph_windows)
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
    parser.add_argument("--graph-windows", default=env_default("graph_windows", ""),
                        help="chunk window lengths (context + chunk frames) captured as CUDA graphs at start-up; "
                             "others are captured on first use (default: those of the talker's default chunks, "
                             "4, 8, 16, 25, ..., with --left-context frames of context)")
    args = parser.parse_args(argv)

    def run() -> None:
        windows = (parse_buckets(args.graph_windows, "--graph-windows")  # the same syntax: positive integers
                   if args.graph_windows else DEFAULT_CHUNKS.windows(args.left_context))
        config = Code2WavConfig(serving=serving_config_from_args(args), model=model_config_from_args(args),
                                left_context=args.left_context, decoder=args.decoder, graph_windows=windows)
        serve_stage("code2wav", create_server, config, args.port_file)

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
