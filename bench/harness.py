"""`omni-bench`: the pipeline and the transformers reference side by side, in one invocation.

Steps: load the reference model in this process; start the stack (unless --target); warm every
system up; time the first-chunk floor; then, for each concurrency level, `rounds` rounds in
which each system serves the same prompts (the order flips every round, so drift hits every
system); time the floor again; summarize; write the table, bench.json and bench.png.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from bench import long_session, realtime
from bench.config import BenchConfig, build_parser, config_from_args
from bench.conversations import render, run_conversations, write
from bench.floor import FloorMeter, FloorSample, summarize_floor
from bench.machine import describe_machine
from bench.metrics import ratio, summarize
from bench.plot import write_plot
from bench.progress import Progress
from bench.prompts import BenchPrompt, built_in_prompts, load_jsonl
from bench.reference import Reference, load_reference
from bench.report import (
    NOTES,
    BenchReport,
    BlockLog,
    ResultRow,
    Skipped,
    gateway_cost_for,
    ratios_for,
    render_table,
    write_json,
)
from bench.stage_metrics import StageScraper, StageTimes, interval
from bench.systems import (
    BatchedReferenceSystem,
    BlockResult,
    GatewaySystem,
    Outcome,
    PipelineSystem,
    ReferenceSystem,
    RequestRecord,
    System,
)
from services.base.errors import UserError, run_cli
from services.runtime.model.checkpoint import check_folder
from services.tools.launcher import Stack, StackOptions, free_port_block

FLOOR_PROMPTS = 4  # the floor is sampled on the first prompts of the set


@dataclass(frozen=True)
class RunBlock:
    """One system at one concurrency for one round, on these prompts: the unit the harness runs and logs."""

    system: System
    concurrency: int
    round: int
    prompt_indices: tuple[int, ...]


def plan_run_blocks(config: BenchConfig, n_prompts: int) -> list[RunBlock]:
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
                blocks.append(RunBlock(system, level, r, indices))
    return blocks


def quiet_libraries() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")


class Bench:
    """One invocation: `setup`, `warm_up`, `measure_floor`, `run_blocks`, `measure_floor`, `report`."""

    def __init__(self, config: BenchConfig, progress_stream=None):
        import torch

        check_folder(config.checkpoint)
        quiet_libraries()
        torch.set_num_threads(config.threads)
        self.layouts: dict[str, str] = {}  # system -> its stack's CPU layout (a note in the report)
        self.config = config
        self.started = time.perf_counter()
        self.machine = describe_machine()
        self.prompts: list[BenchPrompt] = load_jsonl(config.prompts_file) if config.prompts_file else built_in_prompts()
        self.blocks = plan_run_blocks(config, len(self.prompts))
        self.skipped: list[Skipped] = []
        if System.REFERENCE_BATCHED in config.systems and 1 in config.concurrency:
            self.skipped.append(Skipped(System.REFERENCE_BATCHED, 1, "a batch of one is the reference row"))
        self.progress = Progress(sum(len(b.prompt_indices) for b in self.blocks), stream=progress_stream)
        self.setup_s: dict[str, float] = {}  # step -> seconds
        self.systems: dict = {}  # System -> ReferenceSystem | BatchedReferenceSystem | PipelineSystem
        self.floor_samples: list[FloorSample] = []
        self.burst_floor: dict[int, float] = {}  # concurrency -> median ms to first audio (floor.py)
        self.records: list[RequestRecord] = []
        self.block_log: list[BlockLog] = []
        self.walls: dict[tuple[System, int], float] = {}  # (system, level) -> block walls summed over rounds
        self.scrapers: dict[System, StageScraper] = {}  # stacks started here: their stages' metrics
        self.stage_times: dict[tuple[System, int], dict[str, StageTimes]] = {}
        self.exact_kernels: dict[str, dict[str, dict[str, str]]] = {}  # system -> process -> op -> path

    def _step(self, name: str, fn):
        self.progress.note(f"omni-bench: {name} ...")
        t = time.perf_counter()
        result = fn()
        self.setup_s[name] = self.setup_s.get(name, 0.0) + time.perf_counter() - t
        return result

    def setup(self, cleanup: contextlib.ExitStack) -> None:
        """Load the reference here, start the stack (unless --target); `cleanup` stops them."""

        cfg = self.config
        runner = self._step("load reference", lambda: load_reference(cfg.checkpoint, cfg.device, cfg.dtype))
        reference = Reference(runner, cfg.device, cfg.voice, cfg.max_new_tokens, cfg.talker_max_new_tokens)
        self.systems[System.REFERENCE] = ReferenceSystem(reference)
        cleanup.callback(self.systems[System.REFERENCE].close)
        self.systems[System.REFERENCE_BATCHED] = BatchedReferenceSystem(reference)
        self.meter = FloorMeter(runner, cfg.device, cfg.voice, cfg.max_new_tokens, cfg.talker_max_new_tokens,
                                cfg.first_chunk_frames)
        for system, batch in ((System.PIPELINE, ()), (System.PIPELINE_UNBATCHED, ("--max-batch-size", "1")),
                              (System.PIPELINE_GEMM, ())):
            if system not in cfg.systems:
                continue
            target = cfg.target if system is System.PIPELINE else None
            if system is not System.PIPELINE and cfg.target is not None:
                self.skipped.append(Skipped(system, None, "--target given: no second stack started here"))
                continue
            gateway_url = cfg.gateway_url if system is System.PIPELINE else None
            if target is None:
                # The gateway rides on the pipeline's stack; its requests cannot name the talker's
                # length, so that stack's talker default is the benchmark's (gRPC requests set it anyway).
                gateway = cfg.gateway and system is System.PIPELINE
                talker_default = ("--default-max-new-tokens", str(cfg.talker_max_new_tokens)) if gateway else ()
                stack = Stack(StackOptions(
                    checkpoint=cfg.checkpoint, port=0, threads=cfg.threads,
                    thinker_args=cfg.stage_args() + batch + cfg.exact_args(system),
                    talker_args=cfg.talker_args() + batch + cfg.exact_args(system) + talker_default,
                    code2wav_args=cfg.stage_args(),
                    log_prefix=False, http_port=0 if gateway else None, metrics_base_port=free_port_block(),
                    device=cfg.device, cpu_layout=cfg.cpu_layout))
                self._step(f"start stack ({system.value})", lambda stack=stack: cleanup.enter_context(stack))
                self.layouts[system.value] = stack.describe_layout()
                target = stack.target
                gateway_url = stack.http_url
                self.scrapers[system] = StageScraper.for_stack(stack)
                self.exact_kernels[system.value] = self.scrapers[system].exact_kernels()
            pipeline = PipelineSystem(target, cfg.voice, cfg.max_new_tokens, cfg.talker_max_new_tokens, cfg.timeout_s)
            cleanup.callback(pipeline.close)
            self.systems[system] = pipeline
            if system is System.PIPELINE and cfg.gateway:
                if gateway_url is None:
                    self.skipped.append(Skipped(System.GATEWAY, None, "--target given without --gateway-url"))
                else:
                    gateway_system = GatewaySystem(gateway_url, cfg.voice, cfg.max_new_tokens, cfg.timeout_s)
                    cleanup.callback(gateway_system.close)
                    self.systems[System.GATEWAY] = gateway_system
        if cfg.gateway and System.PIPELINE not in cfg.systems:
            self.skipped.append(Skipped(System.GATEWAY, None, "runs on the pipeline's stack: do not skip pipeline"))

    def warm_up(self) -> None:
        """One request per system and one floor pass, not counted: first-call costs (allocator,
        kernels, connections)."""
        self._step("warm up", self._warm_up)

    def _warm_up(self) -> None:
        first, cfg = self.prompts[0], self.config
        for system in (System.PIPELINE, System.PIPELINE_UNBATCHED, System.PIPELINE_GEMM, System.GATEWAY):
            if system in self.systems:
                pipeline: PipelineSystem | GatewaySystem = self.systems[system]
                outcome: Outcome = pipeline.call(pipeline.request(first))
                if outcome.timing is None:
                    raise UserError(f"{system.value} warm-up request failed: {outcome.error}")
        reference = self.systems[System.REFERENCE].reference
        if System.REFERENCE in cfg.systems:
            reference.generate([first])
        batched_levels = [n for n in cfg.concurrency if n > 1]
        if System.REFERENCE_BATCHED in cfg.systems and batched_levels:
            try:
                reference.generate([self.prompts[i % len(self.prompts)] for i in range(min(batched_levels[0], 2))])
            except Exception as exc:  # transformers cannot batch these inputs: say why and go on
                self.skipped.append(Skipped(System.REFERENCE_BATCHED, None,
                                            f"generate failed on a batch: {type(exc).__name__}: {exc}"))
        self.meter.measure(first)

    def measure_floor(self, passes: int) -> None:
        """`passes` over the first prompts; called before and after the blocks to catch drift."""
        if passes > 0:
            self._step("floor", lambda: self.floor_samples.extend(
                self.meter.measure(p, i) for _ in range(passes) for i, p in enumerate(self.prompts[:FLOOR_PROMPTS])))

    def measure_burst_floor(self, passes: int = 2) -> None:
        """The burst floor at each concurrency above 1 the pipeline runs: the median of `passes`
        bursts' medians, on the prompts the pipeline's blocks start with."""
        levels = [n for n in self.config.concurrency if n > 1]
        if System.PIPELINE not in self.config.systems or not levels:
            return

        def measure() -> None:
            for n in levels:
                bursts = [self.meter.measure_burst([self.prompts[i % len(self.prompts)] for i in range(n)])
                          for _ in range(passes)]
                medians = [statistics.median(b) for b in bursts if b]
                if medians:
                    self.burst_floor[n] = statistics.median(medians)
        self._step("burst floor", measure)

    def run_blocks(self) -> None:
        cfg, progress = self.config, self.progress
        for block in self.blocks:
            if any(s.system is block.system and s.concurrency in (None, block.concurrency) for s in self.skipped):
                progress.advance(len(block.prompt_indices))
                continue
            progress.begin(f"{block.system.value} c={block.concurrency} round {block.round + 1}/{cfg.rounds}")
            scraper = self.scrapers.get(block.system)
            before = scraper.snapshot() if scraper else None
            result: BlockResult = self.systems[block.system].run(
                [self.prompts[i] for i in block.prompt_indices], block.concurrency, lambda _: progress.advance())
            if scraper:
                totals = self.stage_times.setdefault((block.system, block.concurrency), {})
                for name, times in interval(before, scraper.snapshot()).items():
                    totals[name] = totals[name].plus(times) if name in totals else times
            progress.end_block()
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            self.block_log.append(BlockLog(block.system, block.concurrency, block.round, len(result.outcomes),
                                           result.wall_s, load))
            key = (block.system, block.concurrency)
            self.walls[key] = self.walls.get(key, 0.0) + result.wall_s
            self.records += [RequestRecord(block.system, block.concurrency, block.round, i, o)
                             for i, o in zip(block.prompt_indices, result.outcomes)]
            if block.system is System.REFERENCE_BATCHED and all(o.timing is None for o in result.outcomes):
                self.skipped.append(Skipped(block.system, None,
                                            f"generate failed on a batch: {result.outcomes[0].error}"))
        progress.close()

    def report(self) -> BenchReport:
        cfg = self.config
        floor = summarize_floor(self.floor_samples, cfg.first_chunk_frames) if self.floor_samples else None
        results = []
        for (system, level), wall in self.walls.items():
            outcomes = [r.outcome for r in self.records if r.system is system and r.concurrency == level]
            summary = summarize([o.timing for o in outcomes if o.timing is not None],
                                errors=sum(1 for o in outcomes if o.timing is None), wall_s=wall,
                                prebuffer_s=cfg.prebuffer_ms / 1000)
            results.append(ResultRow(system, level, summary,
                                     ratio(summary.ttfp_ms.p50, floor.floor_ms if floor else None)))
        return BenchReport(
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            machine=self.machine, config=cfg, checkpoint_name=Path(cfg.checkpoint).resolve().name,
            prompts=[f"{p.label} ({p.modalities})" for p in self.prompts],
            notes=NOTES + tuple(f"{system} stack: {layout}" for system, layout in self.layouts.items()), floor=floor,
            results=results, ratios=ratios_for(results), gateway_cost=gateway_cost_for(results),
            skipped=self.skipped, requests=self.records,
            blocks=self.block_log, setup_s=self.setup_s, wall_s=time.perf_counter() - self.started,
            stage_times=self.stage_times, burst_floor=self.burst_floor, exact_kernels=self.exact_kernels,
        )


def run(config: BenchConfig, progress_stream=None) -> BenchReport:
    bench = Bench(config, progress_stream)
    before = (config.floor_repeats + 1) // 2
    with contextlib.ExitStack() as cleanup:
        bench.setup(cleanup)
        bench.warm_up()
        bench.measure_floor(before)
        bench.run_blocks()
        bench.measure_floor(config.floor_repeats - before)
        bench.measure_burst_floor()
    return bench.report()


def write_outputs(report: BenchReport, out: Path) -> tuple[Path, Path]:
    json_path, png_path = out / "bench.json", out / "bench.png"
    write_json(report, json_path)
    write_plot(report, png_path)
    return json_path, png_path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def go() -> None:
        config = config_from_args(args)
        if config.realtime and config.session_minutes:
            path = Path(config.out) / "long_session.json"
            print(long_session.run_and_report(config.checkpoint, config.session_minutes, (256, 0), str(path)))
            print(f"wrote {path}")
            return
        if config.realtime:
            results, leaked = realtime.run_realtime(config.checkpoint, config.realtime, config.turns, max_tokens=16,
                                                    max_frames=300, barge_after_s=0.3)
            print(realtime.render(results, leaked))
            path = Path(config.out) / "realtime.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(realtime.as_json(results, leaked))
            print(f"wrote {path}")
            return
        if config.conversations:
            report = run_conversations(config)
            print(render(report))
            print(f"wrote {write(report, config)}")
            return
        report = run(config)
        json_path, png_path = write_outputs(report, config.out)
        print(render_table(report))
        print(f"wrote {json_path} and {png_path}")

    return run_cli(go)


if __name__ == "__main__":
    sys.exit(main())
