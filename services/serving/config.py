"""Service configuration: one frozen dataclass per service, filled from flags once at start-up.

Every flag also reads an environment variable (OMNI_<FLAG>, e.g. OMNI_CHECKPOINT), so the
Kubernetes ConfigMap can set them; flags win over the environment.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from services.runtime.cuda_graphs import (
    DEFAULT_BUCKETS,
    GraphSettings,
    graphs_wanted,
    parse_buckets,
)
from services.serving.grpc_server import DEFAULT_MAX_MESSAGE_BYTES
from services.serving.security import TLSConfig, add_tls_flags, tls_from_args


def env_default(name: str, default):
    value = os.environ.get("OMNI_" + name.upper().replace("-", "_"))
    if value is None:
        return default
    return type(default)(value) if default is not None and not isinstance(default, bool) else value


@dataclass(frozen=True)
class StageConfig:
    checkpoint: str
    host: str = "0.0.0.0"
    port: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 30.0  # SIGTERM: time to finish in-flight streams
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    metrics_port: int = 0  # Prometheus /metrics over HTTP; 0 = off
    stream_idle_timeout_s: float = 120.0  # a stream with no progress this long is ended (dead peer)
    tls: TLSConfig = TLSConfig()  # plaintext unless certificates are given
    health_port: int = 0  # a plaintext grpc.health.v1-only port (for probes when TLS is on); 0 = none
    graphs: GraphSettings = GraphSettings()  # CUDA graph capture of the decode steps (cuda only)
    random_weights: bool = False  # build the stage from config.json with seeded random weights
    random_seed: int = 0


def env_flag(name: str) -> bool:
    """A boolean flag's default from OMNI_<NAME>: 1/true/yes/on."""
    return str(env_default(name, "")).lower() in ("1", "true", "yes", "on")


def add_stage_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--checkpoint", default=env_default("checkpoint", None),
                        help="Qwen3-Omni checkpoint folder [OMNI_CHECKPOINT]")
    parser.add_argument("--host", default=env_default("host", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=env_default("port", default_port), help="0 = any free port")
    parser.add_argument("--device", default=env_default("device", "cpu"), help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default=env_default("dtype", "float32"), choices=list(DTYPES))
    parser.add_argument("--max-message-mb", type=int, default=env_default("max_message_mb", DEFAULT_MAX_MESSAGE_BYTES >> 20))
    parser.add_argument("--grace-s", type=float, default=env_default("grace_s", 30.0),
                        help="on SIGTERM, seconds to let in-flight streams finish")
    parser.add_argument("--threads", type=int, default=env_default("threads", 0), help="torch threads (0 = default)")
    parser.add_argument("--metrics-port", type=int, default=env_default("metrics_port", 0),
                        help="serve Prometheus metrics on this HTTP port (0 = off)")
    parser.add_argument("--stream-idle-timeout-s", type=float, default=env_default("stream_idle_timeout_s", 120.0),
                        help="end a stream that made no progress for this long (default 120)")
    parser.add_argument("--port-file", help="write the bound port here once serving (for port 0)")
    parser.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default=env_default("cuda_graphs", "auto"),
                        help="capture the decode steps as CUDA graphs per batch bucket (auto: on for cuda, off for cpu)")
    parser.add_argument("--graph-buckets", default=env_default("graph_buckets", ",".join(map(str, DEFAULT_BUCKETS))),
                        help="batch sizes captured; a batch is padded to the next one, above the largest it runs "
                             "eagerly (default %(default)s)")
    parser.add_argument("--random-weights", action="store_true", default=env_flag("random_weights"),
                        help="no weights: build the stage from the folder's config.json on --device in --dtype with "
                             "seeded random weights (for benchmarks at full size; see omni-tiny-checkpoint --full-size)")
    parser.add_argument("--random-seed", type=int, default=env_default("random_seed", 0),
                        help="seed of --random-weights (default 0)")
    add_tls_flags(parser)
    add_health_port_flag(parser)


DTYPES = ("float32", "bfloat16", "float16")


def stage_config_from_args(args: argparse.Namespace) -> StageConfig:
    if not args.checkpoint:
        parser_error("--checkpoint is required (or set OMNI_CHECKPOINT)")
    # argparse checks `choices` on the command line only, not on defaults read from OMNI_* variables.
    if args.dtype not in DTYPES:
        parser_error(f"--dtype / OMNI_DTYPE: {args.dtype!r} is not one of {', '.join(DTYPES)}")
    if getattr(args, "exact_batching", "auto") not in ("auto", "on", "off"):
        parser_error(f"--exact-batching / OMNI_EXACT_BATCHING: {args.exact_batching!r} is not auto, on or off")
    return StageConfig(
        checkpoint=args.checkpoint, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
        max_message_bytes=args.max_message_mb << 20, grace_s=args.grace_s, threads=args.threads,
        metrics_port=args.metrics_port, stream_idle_timeout_s=args.stream_idle_timeout_s,
        tls=tls_from_args(args), health_port=args.health_port,
        graphs=GraphSettings(graphs_wanted(args.cuda_graphs, args.device), parse_buckets(args.graph_buckets)),
        random_weights=bool(args.random_weights), random_seed=args.random_seed,
    )


def add_health_port_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--health-port", type=int, default=env_default("health_port", 0),
                        help="also serve grpc.health.v1 alone, in plaintext, on this port (probes when TLS is on)")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Batching and KV cache capacity of an LM stage (thinker, talker)."""
    parser.add_argument("--max-batch-size", type=int, default=env_default("max_batch_size", 32),
                        help="requests decoded together in one step (default 32)")
    parser.add_argument("--num-slots", type=int, default=env_default("num_slots", 32),
                        help="KV cache slots allocated at start-up: requests holding cache at once (default 32)")
    parser.add_argument("--max-model-len", type=int, default=env_default("max_model_len", 4096),
                        help="cache positions per slot; prompt + max_new_tokens must fit (default 4096)")
    parser.add_argument("--exact-batching", choices=["auto", "on", "off"], default=env_default("exact_batching", "auto"),
                        help="batch-invariant kernels: greedy output independent of the batch "
                             "(auto: on for cpu, off for cuda)")


def exact_batching(args: argparse.Namespace) -> bool:
    return args.exact_batching == "on" or (args.exact_batching == "auto" and not args.device.startswith("cuda"))


def parser_error(message: str) -> None:
    from services.runtime.errors import UserError

    raise UserError(message)
