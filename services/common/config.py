"""Service configuration: one frozen dataclass per service, filled from flags once at start-up.

Every flag also reads an environment variable (OMNI_<FLAG>, e.g. OMNI_CHECKPOINT), so the
Kubernetes ConfigMap can set them; flags win over the environment.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from services.common.grpc_server import DEFAULT_MAX_MESSAGE_BYTES


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


def add_stage_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--checkpoint", default=env_default("checkpoint", None),
                        help="Qwen3-Omni checkpoint folder [OMNI_CHECKPOINT]")
    parser.add_argument("--host", default=env_default("host", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=env_default("port", default_port), help="0 = any free port")
    parser.add_argument("--device", default=env_default("device", "cpu"), help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default=env_default("dtype", "float32"), choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-message-mb", type=int, default=env_default("max_message_mb", DEFAULT_MAX_MESSAGE_BYTES >> 20))
    parser.add_argument("--grace-s", type=float, default=env_default("grace_s", 30.0),
                        help="on SIGTERM, seconds to let in-flight streams finish")
    parser.add_argument("--threads", type=int, default=env_default("threads", 0), help="torch threads (0 = default)")
    parser.add_argument("--port-file", help="write the bound port here once serving (for port 0)")


def stage_config_from_args(args: argparse.Namespace) -> StageConfig:
    if not args.checkpoint:
        parser_error("--checkpoint is required (or set OMNI_CHECKPOINT)")
    return StageConfig(
        checkpoint=args.checkpoint, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
        max_message_bytes=args.max_message_mb << 20, grace_s=args.grace_s, threads=args.threads,
    )


def parser_error(message: str) -> None:
    from services.common.errors import UserError

    raise UserError(message)
