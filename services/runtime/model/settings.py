"""Model-side settings of a stage, filled from flags once at start-up: which checkpoint, on which
device in which dtype, CUDA graphs, batching capacity. Standard library only, so every process
(the router too) can read the OMNI_* environment the same way.

Every flag also reads an environment variable (OMNI_<FLAG>, e.g. OMNI_CHECKPOINT), so the
Kubernetes ConfigMap can set them; flags win over the environment.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from services.base.env import env_default, env_flag
from services.base.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")


DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class GraphSettings:
    """Whether a stage captures CUDA graphs, and for which batch sizes."""

    enabled: bool = False
    buckets: tuple[int, ...] = DEFAULT_BUCKETS


def parse_buckets(text: str, flag: str = "--graph-buckets") -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8): sorted, unique, each >= 1."""
    try:
        buckets = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers like 1,2,4,8") from None
    if not buckets or min(buckets) < 1:
        raise UserError(f"{flag} {text!r}: need at least one value, each >= 1")
    return tuple(sorted(buckets))


def graphs_wanted(flag: str, device: str) -> bool:
    """--cuda-graphs auto|on|off -> enabled. auto: on for cuda devices only."""
    is_cuda = str(device).startswith("cuda")
    if flag == "on" and not is_cuda:
        raise UserError(f"--cuda-graphs on needs a cuda device, got --device {device}")
    return flag == "on" or (flag == "auto" and is_cuda)


def check_cache_folder(flag: str) -> str:
    """--check-cache: "auto" is $XDG_CACHE_HOME/omni-serve/checks (~/.cache/omni-serve/checks); ""
    keeps no verdicts; anything else is the folder."""
    if flag != "auto":
        return flag
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "omni-serve", "checks")


@dataclass(frozen=True)
class CheckSettings:
    """Exact mode's start-up checks (services/runtime/checks.py): beside serving or before
    it, and where verdicts are kept ("": nowhere, every start checks)."""

    background: bool = False  # the stages' flag defaults to beside serving; in-process engines check first
    cache: str = ""


@dataclass(frozen=True)
class ModelConfig:
    """What a stage loads and where it runs it."""

    checkpoint: str
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    graphs: GraphSettings = GraphSettings()  # CUDA graph capture of the decode steps (cuda only)
    random_weights: bool = False  # build the stage from config.json with seeded random weights
    random_seed: int = 0
    checks: CheckSettings = CheckSettings()


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default=env_default("checkpoint", None),
                        help="Qwen3-Omni checkpoint folder [OMNI_CHECKPOINT]")
    parser.add_argument("--device", default=env_default("device", "cpu"), help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default=env_default("dtype", "float32"), choices=list(DTYPES))
    parser.add_argument("--threads", type=int, default=env_default("threads", 0), help="torch threads (0 = default)")
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
    parser.add_argument("--startup-checks", choices=["background", "before-serving"],
                        default=env_default("startup_checks", "background"),
                        help="exact mode's check of faster batched kernels: background (default): serve at once on "
                             "the plan that is exact by construction and adopt the faster one when the check "
                             "passes; before-serving: check first")
    parser.add_argument("--check-cache", default=env_default("check_cache", "auto"),
                        help="folder where start-up check verdicts are kept, keyed by the CPU, torch, threads and "
                             "shapes, so a restart on the same machine reuses them (auto, the default: "
                             "$XDG_CACHE_HOME/omni-serve/checks, else ~/.cache/omni-serve/checks; '' = keep none) "
                             "[OMNI_CHECK_CACHE]")


def model_config_from_args(args: argparse.Namespace) -> ModelConfig:
    if not args.checkpoint:
        raise UserError("--checkpoint is required (or set OMNI_CHECKPOINT)")
    # argparse checks `choices` on the command line only, not on defaults read from OMNI_* variables.
    if args.dtype not in DTYPES:
        raise UserError(f"--dtype / OMNI_DTYPE: {args.dtype!r} is not one of {', '.join(DTYPES)}")
    if getattr(args, "exact_batching", "auto") not in EXACT_CHOICES:
        raise UserError(f"--exact-batching / OMNI_EXACT_BATCHING: {args.exact_batching!r} is not one of "
                        f"{', '.join(EXACT_CHOICES)}")
    if args.startup_checks not in ("background", "before-serving"):
        raise UserError(f"--startup-checks / OMNI_STARTUP_CHECKS: {args.startup_checks!r} is not background or "
                        "before-serving")
    if getattr(args, "exact_batching", "auto") == "gemm" and (args.device != "cpu" or args.dtype != "float32"):
        raise UserError("--exact-batching gemm runs omni's invariant GEMM: --device cpu --dtype float32 only")
    return ModelConfig(
        checkpoint=args.checkpoint, device=args.device, dtype=args.dtype, threads=args.threads,
        graphs=GraphSettings(graphs_wanted(args.cuda_graphs, args.device), parse_buckets(args.graph_buckets)),
        random_weights=bool(args.random_weights), random_seed=args.random_seed,
        checks=CheckSettings(background=args.startup_checks != "before-serving",
                             cache=check_cache_folder(args.check_cache)),
    )


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Batching and KV cache capacity of an LM stage (thinker, talker)."""
    parser.add_argument("--max-batch-size", type=int, default=env_default("max_batch_size", 32),
                        help="requests decoded together in one step (default 32)")
    parser.add_argument("--max-prefills-per-step", type=int, default=env_default("max_prefills_per_step", -1),
                        help="waiting requests prefilled in one step beside the decode batch (0: every one that "
                             "fits the slots, the batch and --max-prefill-tokens; default -1: 0 where exact "
                             "batching is off, which packs them into one forward, 1 where it is on, which "
                             "prefills each alone)")
    parser.add_argument("--max-prefill-tokens", type=int, default=env_default("max_prefill_tokens", 2048),
                        help="prompt tokens prefilled in one step: bounds how long the running requests wait; a "
                             "longer prompt is prefilled a chunk a step (exact batching on: whole, in a step of its "
                             "own) (default 2048; 0 = no bound)")
    parser.add_argument("--num-slots", type=int, default=env_default("num_slots", 32),
                        help="KV cache slots allocated at start-up: requests holding cache at once (default 32)")
    parser.add_argument("--max-model-len", type=int, default=env_default("max_model_len", 4096),
                        help="cache positions per slot; prompt + max_new_tokens must fit (default 4096)")
    parser.add_argument("--exact-batching", choices=EXACT_CHOICES, default=env_default("exact_batching", "auto"),
                        help="batch-invariant kernels: greedy output independent of the batch "
                             "(auto: on for cpu, off for cuda; on: per-row kernels, batched ones where the "
                             "start-up check finds them invariant, bit-exact with generate; gemm: omni's "
                             "invariant GEMM for every linear layer, fast at width, bit-exact with "
                             "generate run through the same op; cpu float32 only)")
    parser.add_argument("--device-sampling", choices=["auto", "on", "off"],
                        default=env_default("device_sampling", "auto"),
                        help="draw tokens on the model's device, a step's rows in one batched pass and one copy "
                             "back (auto: on for cuda; off: the host's draws, generate's bit for bit on CPU)")


def device_sampling(args: argparse.Namespace) -> bool | None:
    """--device-sampling auto|on|off -> the engines' `device_sampling` (None: on where the device is cuda)."""
    if args.device_sampling not in ("auto", "on", "off"):
        raise UserError(f"--device-sampling / OMNI_DEVICE_SAMPLING: {args.device_sampling!r} is not auto, on or off")
    return None if args.device_sampling == "auto" else args.device_sampling == "on"


def check_engine_flags(args: argparse.Namespace) -> None:
    """add_engine_flags' values, refused with the flag named."""
    for flag in ("max_batch_size", "num_slots", "max_model_len"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.max_prefills_per_step < -1:
        raise UserError(f"--max-prefills-per-step must be -1 (auto), 0 (no cap) or more, got {args.max_prefills_per_step}")
    if args.max_prefill_tokens < 0:
        raise UserError(f"--max-prefill-tokens must be 0 (no bound) or more, got {args.max_prefill_tokens}")


def on_unless_cuda(choice: str, device: str) -> bool:
    """An auto|on|off flag whose auto is on everywhere but on CUDA devices."""
    return choice == "on" or (choice == "auto" and not device.startswith("cuda"))


EXACT_CHOICES = ("auto", "on", "off", "gemm")


def exact_batching(args: argparse.Namespace) -> bool:
    return args.exact_batching == "gemm" or on_unless_cuda(args.exact_batching, args.device)


def exact_gemm(args: argparse.Namespace) -> bool:
    """`--exact-batching gemm`: linear layers and experts through the invariant GEMM."""
    return args.exact_batching == "gemm"


DEFAULT_PREFIX_CACHE_MB = 2048


def add_prefix_cache_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """--prefix-cache-mb of an LM stage (services/runtime/lm/prefix/)."""
    parser.add_argument("--prefix-cache-mb", type=int, default=env_default("prefix_cache_mb", -1),
                        help=f"prefix cache pool: {what} (default -1: an eighth of the host's memory, at most "
                             f"{DEFAULT_PREFIX_CACHE_MB}; 0 = off)")


def prefix_cache_mb(flag: int) -> int:
    """--prefix-cache-mb: as given (0: off), or, below 0, an eighth of the host's memory, at most 2048."""
    if flag >= 0:
        return flag
    import os

    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    return min(DEFAULT_PREFIX_CACHE_MB, memory_mb // 8)
