"""`omni-bench`: the pipeline and the transformers reference side by side, in one invocation.

Steps: load the reference model in this process; start the stack (unless --target); warm every
system up; time the first-chunk floor; then, for each concurrency level, `rounds` rounds in
which each system serves the same prompts (the order flips every round, so drift hits every
system); time the floor again; summarize; write the table, bench.json and bench.png.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from bench.config import BenchConfig, build_parser, config_from_args
from bench.floor import FloorMeter, FloorSample, summarize_floor
from bench.machine import describe_machine
from bench.metrics import ratio, summarize
from bench.progress import Progress
from bench.prompts import BenchPrompt, built_in_prompts, load_jsonl
from bench.report import NOTES, BenchReport, ResultRow, Skipped, ratios_for, render_table, write_json
from bench.systems import (
    BatchedReferenceSystem,
    BlockResult,
    Outcome,
    PipelineSystem,
    ReferenceSystem,
    RequestRecord,
    System,
)
from services.common.errors import UserError, run_cli

FLOOR_PROMPTS = 4  # the floor is sampled on the first prompts of the set


@dataclass(frozen=True)
class Block:
    system: System
    concurrency: int
    round: int
    prompt_indices: tuple[int, ...]


def plan_blocks(config: BenchConfig, n_prompts: int) -> list[Block]:
    """Every block in run order. Within a round all systems get the same prompts; successive
    rounds (and levels) move on through the prompt set."""
    blocks, offset = [], 0
    for level in config.concurrency:
        n = config.requests_at(level)
        for r in range(config.rounds):
            indices = tuple((offset + k) % n_prompts for k in range(n))
            offset += n
            order = config.systems if r % 2 == 0 else config.systems[::-1]
            for system in order:
                if system is System.REFERENCE_BATCHED and level == 1:
                    continue  # a batch of one is the reference row
                blocks.append(Block(system, level, r, indices))
    return blocks


def quiet_libraries() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")


def run(config: BenchConfig, progress_stream=None) -> BenchReport:
    import torch

    from bench.reference import Reference, load_reference
    from router.launcher import Stack, StackOptions
    from services.common.checkpoint import check_folder

    started = time.perf_counter()
    check_folder(config.checkpoint)
    quiet_libraries()
    torch.set_num_threads(config.threads)
    machine = describe_machine()
    prompts: list[BenchPrompt] = load_jsonl(config.prompts_file) if config.prompts_file else built_in_prompts()
    blocks = plan_blocks(config, len(prompts))
    skipped: list[Skipped] = []
    if System.REFERENCE_BATCHED in config.systems and 1 in config.concurrency:
        skipped.append(Skipped(System.REFERENCE_BATCHED, 1, "a batch of one is the reference row"))
    progress = Progress(sum(len(b.prompt_indices) for b in blocks), stream=progress_stream)
    setup: dict[str, float] = {}  # step -> seconds

    def step(name: str, fn):
        progress.note(f"omni-bench: {name} ...")
        t = time.perf_counter()
        result = fn()
        setup[name] = time.perf_counter() - t
        return result

    runner = step("load reference", lambda: load_reference(config.checkpoint, config.device, config.dtype))
    reference = Reference(runner, config.device, config.voice, config.max_new_tokens, config.talker_max_new_tokens)
    systems = {System.REFERENCE: ReferenceSystem(reference), System.REFERENCE_BATCHED: BatchedReferenceSystem(reference)}
    meter = FloorMeter(runner, config.device, config.voice, config.max_new_tokens, config.talker_max_new_tokens,
                       config.first_chunk_frames)
    floor_prompts = list(enumerate(prompts[:FLOOR_PROMPTS]))
    floor_samples: list[FloorSample] = []
    records: list[RequestRecord] = []
    walls: dict[tuple[System, int], float] = {}  # (system, level) -> block walls summed over rounds

    with contextlib.ExitStack() as cleanup:
        if System.PIPELINE in config.systems:
            target = config.target
            if target is None:
                stack = Stack(StackOptions(
                    checkpoint=config.checkpoint, port=0, threads=config.threads, thinker_args=config.stage_args(),
                    talker_args=config.stage_args(), code2wav_args=config.stage_args(), log_prefix=False))
                step("start stack", lambda: cleanup.enter_context(stack))
                target = stack.target
            pipeline = PipelineSystem(target, config.voice, config.max_new_tokens, config.talker_max_new_tokens,
                                      config.timeout_s)
            cleanup.callback(pipeline.close)
            systems[System.PIPELINE] = pipeline

        step("warm up", lambda: warm_up(config, systems, prompts, skipped))
        before = (config.floor_repeats + 1) // 2
        step("floor", lambda: floor_samples.extend(
            meter.measure(p, i) for _ in range(before + 1) for i, p in floor_prompts))
        del floor_samples[:len(floor_prompts)]  # the first pass warms the engines up

        for block in blocks:
            if any(s.system is block.system and s.concurrency in (None, block.concurrency) for s in skipped):
                progress.advance(len(block.prompt_indices))
                continue
            progress.begin(f"{block.system.value} c={block.concurrency} round {block.round + 1}/{config.rounds}")
            result: BlockResult = systems[block.system].run(
                [prompts[i] for i in block.prompt_indices], block.concurrency, lambda _: progress.advance())
            progress.end_block()
            key = (block.system, block.concurrency)
            walls[key] = walls.get(key, 0.0) + result.wall_s
            records += [RequestRecord(block.system, block.concurrency, block.round, i, o)
                        for i, o in zip(block.prompt_indices, result.outcomes)]
            if block.system is System.REFERENCE_BATCHED and all(o.timing is None for o in result.outcomes):
                skipped.append(Skipped(block.system, None, f"generate failed on a batch: {result.outcomes[0].error}"))

        after = config.floor_repeats - before
        if after:
            step("floor again", lambda: floor_samples.extend(
                meter.measure(p, i) for _ in range(after) for i, p in floor_prompts))
    progress.close()

    floor = summarize_floor(floor_samples, config.first_chunk_frames) if floor_samples else None
    results = []
    for system, level in walls:
        outcomes = [r.outcome for r in records if r.system is system and r.concurrency == level]
        summary = summarize([o.timing for o in outcomes if o.timing is not None],
                            errors=sum(1 for o in outcomes if o.timing is None), wall_s=walls[(system, level)],
                            prebuffer_s=config.prebuffer_ms / 1000)
        results.append(ResultRow(system, level, summary,
                                 ratio(summary.ttfp_ms.p50, floor.floor_ms if floor else None)))
    return BenchReport(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=machine, config=config, checkpoint_name=Path(config.checkpoint).resolve().name,
        prompts=[f"{p.label} ({p.modalities})" for p in prompts], notes=NOTES, floor=floor, results=results,
        ratios=ratios_for(results), skipped=skipped, requests=records, setup_s=setup,
        wall_s=time.perf_counter() - started,
    )


def warm_up(config: BenchConfig, systems: dict, prompts: list[BenchPrompt], skipped: list[Skipped]) -> None:
    """One request per system, not counted: first-call costs (allocator, kernels, connections)."""
    first = prompts[0]
    if System.PIPELINE in systems:
        pipeline: PipelineSystem = systems[System.PIPELINE]
        outcome: Outcome = pipeline.call(pipeline.request(first))
        if outcome.timing is None:
            raise UserError(f"pipeline warm-up request failed: {outcome.error}")
    reference: ReferenceSystem = systems[System.REFERENCE]
    if System.REFERENCE in config.systems:
        reference.reference.generate([first])
    batched_levels = [n for n in config.concurrency if n > 1]
    if System.REFERENCE_BATCHED in config.systems and batched_levels:
        batch = [prompts[i % len(prompts)] for i in range(min(batched_levels[0], 2))]
        try:
            reference.reference.generate(batch)
        except Exception as exc:  # transformers cannot batch these inputs: say why and go on
            skipped.append(Skipped(System.REFERENCE_BATCHED, None, f"generate failed on a batch: "
                                                                   f"{type(exc).__name__}: {exc}"))


def write_outputs(report: BenchReport, out: Path) -> tuple[Path, Path]:
    from bench.plot import write_plot

    json_path, png_path = out / "bench.json", out / "bench.png"
    write_json(report, json_path)
    write_plot(report, png_path)
    return json_path, png_path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def go() -> None:
        config = config_from_args(args)
        report = run(config)
        json_path, png_path = write_outputs(report, config.out)
        print(render_table(report))
        print(f"wrote {json_path} and {png_path}")

    return run_cli(go)


if __name__ == "__main__":
    sys.exit(main())
