"""What tracing costs: the same stack with tracing off and on (every request traced, spans exported
over OTLP/gRPC to a collector in this process), side by side, in alternating rounds.

    python -m bench.tracing_cost --checkpoint models/tiny-qwen3-omni --concurrency 1,16

Two stacks of the same configuration run at once; within each concurrency level the rounds
alternate which one goes first, so drift hits both. Prints requests per second of each and their
ratio (traced / untraced) per level, and writes tracing_cost.json. The collector runs in this
process, beside the load generator: a real one runs elsewhere, so this errs on the costly side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.presets import PRESETS, ensure_checkpoint
from bench.prompts import built_in_prompts
from bench.systems import PipelineSystem
from services.runtime.errors import run_cli
from services.tools.launcher import Stack, StackOptions
from services.tools.otlp_sink import OtlpSink


@dataclass(frozen=True)
class Level:
    concurrency: int
    requests: int  # per stack and round
    untraced_req_per_s: list[float]  # one per round
    traced_req_per_s: list[float]
    errors: int

    @property
    def ratio(self) -> float:
        """traced / untraced, of the requests per second summed over the rounds (1.0 = free)."""
        return sum(self.traced_req_per_s) / sum(self.untraced_req_per_s)


def run_block(system: PipelineSystem, prompts, concurrency: int) -> tuple[float, int]:
    result = system.run(prompts, concurrency)
    errors = sum(1 for o in result.outcomes if o.timing is None)
    return (len(result.outcomes) - errors) / result.wall_s, errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tracing_cost", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="checkpoint folder (default: the tiny one, generated if missing)")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--requests", type=int, default=8, help="per stack, level and round; raised to the concurrency")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--talker-max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out"))
    args = p.parse_args(argv)

    def run() -> None:
        checkpoint = args.checkpoint or str(ensure_checkpoint(PRESETS["tiny"]))
        levels = [int(c) for c in args.concurrency.split(",")]
        prompts = built_in_prompts()
        stage = ("--device", args.device)
        os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "1000")
        with contextlib.ExitStack() as cleanup:
            sink = cleanup.enter_context(OtlpSink())
            systems = {}
            for name, extra in (("untraced", ()), ("traced", ("--otlp-endpoint", sink.endpoint))):
                stack = cleanup.enter_context(Stack(StackOptions(
                    checkpoint=checkpoint, port=0, threads=args.threads, thinker_args=stage, talker_args=stage,
                    code2wav_args=stage, extra_args=extra, log_prefix=False, device=args.device)))
                systems[name] = PipelineSystem(stack.target, None, args.max_new_tokens, args.talker_max_new_tokens, 600)
                cleanup.callback(systems[name].close)
            for system in systems.values():  # first-call costs, not counted
                run_block(system, prompts[:2], 2)
            results = []
            for concurrency in levels:
                n = max(args.requests, concurrency)
                block = [prompts[i % len(prompts)] for i in range(n)]
                rates = {"untraced": [], "traced": []}
                errors = 0
                for r in range(args.rounds):
                    for name in (("untraced", "traced") if r % 2 == 0 else ("traced", "untraced")):
                        rate, failed = run_block(systems[name], block, concurrency)
                        rates[name].append(rate)
                        errors += failed
                level = Level(concurrency, n, rates["untraced"], rates["traced"], errors)
                results.append(level)
                print(f"c={concurrency:<3} untraced {statistics.median(level.untraced_req_per_s):.3f} req/s  traced "
                      f"{statistics.median(level.traced_req_per_s):.3f} req/s  ratio {level.ratio:.3f} "
                      f"(rounds: {' '.join(f'{t / u:.3f}' for u, t in zip(level.untraced_req_per_s, level.traced_req_per_s))})"
                      f"  errors {errors}", flush=True)
            time.sleep(1.5)  # the last batch of spans
            spans = len(sink.spans())
        print(f"{spans} spans received")
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"checkpoint": checkpoint, "device": args.device, "rounds": args.rounds, "spans": spans,
                  "levels": [{**asdict(level), "ratio": level.ratio} for level in results]}
        (args.out / "tracing_cost.json").write_text(json.dumps(report, indent=1) + "\n")

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
