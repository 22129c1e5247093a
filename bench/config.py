"""The benchmark's configuration: built once from the command line, validated, frozen."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from bench.presets import PRESETS, ensure_checkpoint
from bench.systems import System
from services.base.errors import UserError
from services.base.families import Family, family_of

# Defaults sized so that `make bench` (tiny checkpoint, all three systems at concurrency 1, 4
# and 16) ends in about 3 minutes on 2 idle CPU cores and in about 5 with other work loading
# them 3x over, inside its 10-minute budget. Random weights never emit EOS: every request runs
# to its max tokens.
DEFAULT_CONCURRENCY = (1, 4, 16)
DEFAULT_REQUESTS = 6  # per system, concurrency level and round; raised to the concurrency
DEFAULT_ROUNDS = 2
DEFAULT_MAX_NEW_TOKENS = 32
DEFAULT_TALKER_MAX_NEW_TOKENS = 64  # 63 frames = 5.0 s of audio


@dataclass(frozen=True)
class BenchConfig:
    checkpoint: str
    out: Path
    prompts_file: Path | None  # None = the built-in set
    concurrency: tuple[int, ...]
    requests: int  # per system, level and round; at least the level
    rounds: int  # the systems alternate within each level, this many times
    max_new_tokens: int
    talker_max_new_tokens: int
    voice: str | None
    target: str | None  # a running router; None = start the stack here
    device: str
    dtype: str
    threads: int  # torch threads per stage process and in this process (reference, floor)
    systems: tuple[System, ...]
    floor_repeats: int  # floor samples per prompt, half before and half after the runs
    first_chunk_frames: int  # the talker's first chunk (its --first-chunk-frames)
    prebuffer_ms: float  # the simulated player's start-up buffer
    timeout_s: float
    preset: str = "tiny"  # bench/presets.py
    gateway_url: str | None = None  # with --target: that stack's HTTP gateway (for the gateway system)
    cpu_layout: str = "auto"  # the stacks started here: the talker on CPUs of its own (services/tools/launcher.py)
    exact_batching: str = "auto"  # the thinker's and talker's --exact-batching in the `pipeline` stack
    conversations: int = 0  # --conversations: the conversation mode (bench/conversations.py) instead
    turns: int = 8
    routing_conversations: int = 16
    realtime: tuple[int, ...] = ()  # --realtime: realtime sessions (bench/realtime.py) at these levels instead
    session_minutes: float = 0.0  # with --realtime: one session this long instead (bench/long_session.py)

    @property
    def gateway(self) -> bool:
        return System.GATEWAY in self.systems

    def requests_at(self, concurrency: int) -> int:
        return max(self.requests, concurrency)

    def stage_args(self) -> tuple[str, ...]:
        """What every stage server gets, so the pipeline runs where the reference does, on the plan
        exact mode's start-up check chose (not the one it serves on while the check runs)."""
        return ("--device", self.device, "--dtype", self.dtype, "--startup-checks", "before-serving")

    def talker_args(self) -> tuple[str, ...]:
        """The talker also gets the first chunk's size, so the floor and the stack agree."""
        return self.stage_args() + ("--first-chunk-frames", str(self.first_chunk_frames))

    def exact_args(self, system: System) -> tuple[str, ...]:
        """The thinker's and talker's exact batching in `system`'s stack."""
        return ("--exact-batching", "gemm" if system is System.PIPELINE_GEMM else self.exact_batching)


def resolved_threads(threads: int) -> int:
    """0 = the launcher's default: a third of the cores per stage, at least 1."""
    return threads if threads > 0 else max(1, (os.cpu_count() or 1) // 3)


# The presets' talker budgets are Qwen3-Omni codec frames (12.5 a second); Qwen2.5-Omni's talker
# makes 50 codes a second, so the same seconds of audio take 4x the tokens (64 frames = 256 codes
# = 5.1 s), and its first audio needs 72 codes (a Token2Wav chunk and its look-ahead) anyway.
QWEN2_5_CODES_PER_QWEN3_FRAME = 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-bench",
        description="Benchmark the streaming pipeline against the transformers reference (TTFT, TTFP, RTF, "
                    "throughput, first-chunk floor, playback continuity).")
    p.add_argument("--checkpoint", help="checkpoint folder of either family, Qwen3-Omni or Qwen2.5-Omni (required "
                                        "with --preset tiny; with --preset wide: default models/wide-qwen3-omni, "
                                        "generated when missing)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="tiny: per-step overhead dominates (make bench); wide: a generated ~58 M-parameter "
                        "checkpoint where compute dominates, with fewer tokens per request (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("out"), help="writes bench.json and bench.png here (default out)")
    p.add_argument("--prompts", type=Path, help="JSONL prompt set: {prompt, system?, audio?, image?, video?} per "
                                                "line (default: 8 built-in text prompts and a video prompt)")
    p.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)),
                   help="comma-separated concurrency levels (default %(default)s)")
    p.add_argument("--requests", type=int,
                   help=f"requests per system, level and round; at least the level (default {DEFAULT_REQUESTS}; "
                        f"wide {PRESETS['wide'].requests})")
    p.add_argument("--rounds", type=int,
                   help=f"times the systems alternate within each level (default {DEFAULT_ROUNDS}; "
                        f"wide {PRESETS['wide'].rounds})")
    p.add_argument("--max-new-tokens", type=int,
                   help=f"thinker (default {DEFAULT_MAX_NEW_TOKENS}; wide {PRESETS['wide'].max_new_tokens})")
    p.add_argument("--talker-max-new-tokens", type=int,
                   help=f"talker; N tokens give at most N - 1 frames (default {DEFAULT_TALKER_MAX_NEW_TOKENS}; "
                        f"wide {PRESETS['wide'].talker_max_new_tokens}; a Qwen2.5-Omni checkpoint "
                        f"{QWEN2_5_CODES_PER_QWEN3_FRAME}x those codes, the same seconds of audio)")
    p.add_argument("--voice", help="speaker (default: the checkpoint's default)")
    p.add_argument("--target", help="router host:port of a running stack (default: start one here)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... for the reference, the floor and every "
                                                   "stage started here (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per stage process and for the in-process reference "
                        "(default 0: a third of the cores, at least 1)")
    p.add_argument("--cpu-layout", choices=["auto", "on", "off"], default="auto",
                   help="the stacks started here: each talker on CPUs of its own, the other processes on the rest "
                        "(as omni-serve up; auto = on unless --device is cuda)")
    p.add_argument("--skip", default="", help="comma-separated systems not to run: reference, reference-batched, "
                                              "pipeline, pipeline-unbatched (the same stack at batch size 1)")
    p.add_argument("--floor-repeats", type=int, default=2, help="floor samples per prompt (default %(default)s)")
    p.add_argument("--first-chunk-frames", type=int, default=4,
                   help="frames in the talker's first chunk: for the floor and the talker started here; "
                        "with --target, say what that talker uses (default %(default)s)")
    p.add_argument("--prebuffer-ms", type=float, default=0.0,
                   help="simulated player's buffer before it starts playing (default %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline in seconds")
    p.add_argument("--gateway", action="store_true",
                   help="also run the pipeline's requests through the OpenAI-compatible HTTP gateway (system "
                        "`gateway`) and report what the gateway adds to TTFT/TTFP and costs in throughput")
    p.add_argument("--gateway-url", help="with --target: that stack's gateway, http://host:port")
    p.add_argument("--exact-batching", choices=["auto", "on", "off", "gemm"], default="auto",
                   help="the thinker's and talker's --exact-batching in the pipeline stack (default %(default)s)")
    p.add_argument("--gemm", action="store_true",
                   help="also run `pipeline-gemm`: a second stack with --exact-batching gemm (omni's invariant "
                        "GEMM, cpu float32), side by side with the others (make bench-wide)")
    p.add_argument("--conversations", type=int, default=0,
                   help="conversation mode (bench/conversations.py) instead of the systems above: this many "
                        "conversations at once, prefix cache on against off (text and audio), then "
                        "--routing-conversations over two thinkers, random against prefix routing")
    p.add_argument("--turns", type=int, default=8, help="conversation mode: turns per conversation (default 8)")
    p.add_argument("--routing-conversations", type=int, default=16,
                   help="conversation mode: conversations at once in the routing comparison (default 16)")
    p.add_argument("--realtime", default="",
                   help="realtime mode (bench/realtime.py) instead of the systems above: voice sessions at once "
                        "speaking real speech, over gRPC and through the gateway's WebSocket (--turns utterances "
                        "each), at these levels (1,8,32), or at 1 and then N for a single N")
    p.add_argument("--session-minutes", type=float, default=0.0,
                   help="with --realtime: one session of this many minutes instead, a turn of speech every 15 s, "
                        "the thinker's encoder cache on then off (bench/long_session.py)")
    return p


def _levels(text: str, flag: str = "--concurrency") -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers like 1,4,16") from None
    if not levels or any(n < 1 for n in levels):
        raise UserError(f"{flag} {text!r}: levels must be >= 1")
    return tuple(sorted(set(levels)))


def realtime_levels(text: str) -> tuple[int, ...]:
    """`--realtime`: a list of levels as given (1,8,32); one N alone means 1 and N; "" none."""
    if not text.strip():
        return ()
    levels = _levels(text, "--realtime")
    return levels if "," in text else tuple(sorted({1, *levels}))


def _systems(skip: str, gateway: bool = False, gemm: bool = False) -> tuple[System, ...]:
    names = {s.value: s for s in System}
    skipped = {x.strip() for x in skip.split(",") if x.strip()}
    unknown = skipped - set(names)
    if unknown:
        raise UserError(f"--skip: unknown systems {sorted(unknown)}; known: {', '.join(names)}")
    if not gateway:
        skipped.add(System.GATEWAY.value)  # opt-in
    if not gemm:
        skipped.add(System.PIPELINE_GEMM.value)  # opt-in
    systems = tuple(s for s in System if s.value not in skipped)
    if not systems:
        raise UserError("--skip: nothing left to run")
    return systems


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    preset = PRESETS[getattr(args, "preset", None) or "tiny"]
    if args.checkpoint is None:
        if preset.checkpoint is None:
            raise UserError("--checkpoint is required (or --preset wide, which generates its own)")
        args.checkpoint = str(ensure_checkpoint(preset))
    if getattr(args, "talker_max_new_tokens", None) is None and (Path(args.checkpoint) / "config.json").is_file() \
            and family_of(args.checkpoint) is Family.QWEN2_5_OMNI:
        args.talker_max_new_tokens = preset.talker_max_new_tokens * QWEN2_5_CODES_PER_QWEN3_FRAME
    for name in ("requests", "rounds", "max_new_tokens", "talker_max_new_tokens"):  # unset: the preset's
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(preset, name))
    for name in ("requests", "rounds", "max_new_tokens", "talker_max_new_tokens", "floor_repeats",
                 "first_chunk_frames"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if getattr(args, "gemm", False) and (args.device != "cpu" or args.dtype != "float32"):
        raise UserError("--gemm: the invariant GEMM runs on --device cpu --dtype float32 only")
    if getattr(args, "conversations", 0) < 0 or getattr(args, "turns", 8) < 2 \
            or getattr(args, "routing_conversations", 16) < 1:
        raise UserError("--conversations must be >= 0, --turns >= 2, --routing-conversations >= 1")
    if args.prebuffer_ms < 0 or args.timeout <= 0 or args.threads < 0:
        raise UserError("--prebuffer-ms and --threads must be >= 0, --timeout > 0")
    return BenchConfig(
        checkpoint=str(args.checkpoint), out=args.out, prompts_file=args.prompts, concurrency=_levels(args.concurrency),
        requests=args.requests, rounds=args.rounds, max_new_tokens=args.max_new_tokens,
        talker_max_new_tokens=args.talker_max_new_tokens, voice=args.voice, target=args.target,
        device=args.device, dtype=args.dtype, threads=resolved_threads(args.threads),
        systems=_systems(args.skip, args.gateway, getattr(args, "gemm", False)),
        floor_repeats=args.floor_repeats, first_chunk_frames=args.first_chunk_frames,
        prebuffer_ms=args.prebuffer_ms, timeout_s=args.timeout, gateway_url=args.gateway_url, preset=preset.name,
        cpu_layout=args.cpu_layout, exact_batching=getattr(args, "exact_batching", "auto"),
        conversations=getattr(args, "conversations", 0), turns=getattr(args, "turns", 8),
        routing_conversations=getattr(args, "routing_conversations", 16),
        realtime=realtime_levels(str(getattr(args, "realtime", "") or "")),
        session_minutes=getattr(args, "session_minutes", 0.0),
    )
