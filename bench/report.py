"""The benchmark's result: one typed object, rendered as a terminal table and a JSON file."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass
from pathlib import Path

from bench.config import BenchConfig
from bench.floor import FloorSummary
from bench.machine import Machine
from bench.metrics import BlockSummary, Percentiles, ratio, simulate_playback
from bench.stage_metrics import StageTimes
from bench.systems import RequestRecord, System

SCHEMA = "omni-bench/1"

NOTES = (
    "TTFT: request sent -> first text delta; TTFP: request sent -> first audio chunk; RTF: (last audio chunk - "
    "request sent) / seconds of audio; all at the client (docs/architecture.md, Measures).",
    "reference and reference-batched: transformers' generate streams nothing, so TTFT = TTFP = the time to the "
    "whole response, and their continuity is perfect by construction (one chunk).",
    "reference at concurrency N: N clients in front of one generate at a time (latency includes the wait); "
    "reference-batched: one generate per batch of N requests sent together.",
    "Throughput: completed requests (and seconds of audio) per wall second, first send to last completion of "
    "each block, summed over rounds. Systems alternate within each level (rounds), so drift hits all of them.",
    "floor: thinker prefill + first tokens, talker prefill + first chunk of frames, one code2wav push, timed "
    "in-process on the same modules, one after the other; TTFP/floor = p50 TTFP / median floor.",
    "underruns: simulated playback from chunk arrival times, starting at the first chunk (+ prebuffer); a chunk "
    "arriving after the audio before it ran out is one underrun, as long as the gap.",
    "threads: torch intra-op threads of each stage process and of the one reference process alike; the "
    "pipeline's three stages can together use three times as many.",
    "Other work on the machine biases the comparison: on shared CPUs the pipeline's processes together get a "
    "larger share than the one reference process. blocks[].load_1m shows the load while each block ran.",
)


@dataclass(frozen=True)
class ResultRow:
    system: System
    concurrency: int
    summary: BlockSummary
    ttfp_over_floor: float | None  # p50 TTFP / median floor


@dataclass(frozen=True)
class RatioRow:
    """pipeline / baseline at one concurrency: < 1 is better for latencies and RTF, > 1 for throughput.
    `system`: the pipeline measured (pipeline, or pipeline-gemm)."""

    concurrency: int
    baseline: System
    ttft_p50: float | None
    ttfp_p50: float | None
    rtf_p50: float | None
    req_per_s: float | None
    audio_s_per_s: float | None
    system: System = System.PIPELINE


@dataclass(frozen=True)
class Skipped:
    system: System
    concurrency: int | None  # None: every level
    reason: str


@dataclass(frozen=True)
class BlockLog:
    """One block as it ran: the load average shows other work on the machine at the time."""

    system: System
    concurrency: int
    round: int
    requests: int
    wall_s: float
    load_1m: float | None  # 1-minute load average at the block's end


@dataclass(frozen=True)
class BenchReport:
    created: str  # ISO 8601, UTC
    machine: Machine
    config: BenchConfig
    checkpoint_name: str
    prompts: list[str]  # label and modalities of each prompt
    notes: tuple[str, ...]
    floor: FloorSummary | None
    results: list[ResultRow]
    ratios: list[RatioRow]
    gateway_cost: list[GatewayCostRow]
    skipped: list[Skipped]
    requests: list[RequestRecord]
    blocks: list[BlockLog]  # in run order
    setup_s: dict[str, float]  # step -> seconds: reference load, stack start, warm-up, floor
    wall_s: float
    # (system, concurrency) -> stage process name -> its time over that level's blocks (the stages'
    # own metrics; empty with --target)
    stage_times: dict[tuple[System, int], dict[str, StageTimes]] = dataclasses.field(default_factory=dict)
    # concurrency -> median ms from a burst of that many requests to each one's first audio, in-process
    # (bench/floor.py, the burst floor); levels above 1 with the pipeline measured
    burst_floor: dict[int, float] = dataclasses.field(default_factory=dict)
    # system -> stage process -> op -> the kernel path its exact-batching probe chose
    # (omni_exact_kernel_info: rows, batched or gemm; services/runtime/lm/invariance.py)
    exact_kernels: dict[str, dict[str, dict[str, str]]] = dataclasses.field(default_factory=dict)

    def row(self, system: System, concurrency: int) -> ResultRow | None:
        return next((r for r in self.results if r.system is system and r.concurrency == concurrency), None)

    def level_wall_s(self, system: System, concurrency: int) -> float:
        return sum(b.wall_s for b in self.blocks if b.system is system and b.concurrency == concurrency)


@dataclass(frozen=True)
class GatewayCostRow:
    """What the HTTP gateway adds to the gRPC path, same stack, same requests, same run."""

    concurrency: int
    added_ttft_ms: float | None  # gateway p50 - pipeline p50
    added_ttfp_ms: float | None
    req_per_s: float | None  # gateway / pipeline
    audio_s_per_s: float | None


def gateway_cost_for(results: list[ResultRow]) -> list[GatewayCostRow]:
    out = []
    for gate in (r for r in results if r.system is System.GATEWAY):
        pipe = next((r for r in results if r.system is System.PIPELINE and r.concurrency == gate.concurrency), None)
        if pipe is None:
            continue
        g, p = gate.summary, pipe.summary
        diff = lambda a, b: None if a is None or b is None else a - b  # noqa: E731
        out.append(GatewayCostRow(gate.concurrency, diff(g.ttft_ms.p50, p.ttft_ms.p50),
                                  diff(g.ttfp_ms.p50, p.ttfp_ms.p50), ratio(g.req_per_s, p.req_per_s),
                                  ratio(g.audio_s_per_s, p.audio_s_per_s)))
    return out


def ratios_for(results: list[ResultRow]) -> list[RatioRow]:
    out = []
    pipelines = (System.PIPELINE, System.PIPELINE_GEMM)
    for pipe in (r for r in results if r.system in pipelines):
        for base in (r for r in results if r.system not in (*pipelines, System.GATEWAY)
                     and r.concurrency == pipe.concurrency):
            # pipeline-unbatched is a baseline too: the batching gain of the same stack
            p, b = pipe.summary, base.summary
            out.append(RatioRow(
                concurrency=pipe.concurrency, baseline=base.system,
                ttft_p50=ratio(p.ttft_ms.p50, b.ttft_ms.p50), ttfp_p50=ratio(p.ttfp_ms.p50, b.ttfp_ms.p50),
                rtf_p50=ratio(p.rtf.p50, b.rtf.p50), req_per_s=ratio(p.req_per_s, b.req_per_s),
                audio_s_per_s=ratio(p.audio_s_per_s, b.audio_s_per_s), system=pipe.system,
            ))
    return out


# JSON.

def _jsonable(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else round(value, 6)
    return value


def _request_json(record: RequestRecord, prebuffer_s: float) -> dict:
    timing, outcome = record.outcome.timing, record.outcome
    out = {"system": record.system.value, "concurrency": record.concurrency, "round": record.round,
           "prompt_index": record.prompt_index, "text_tokens": outcome.text_tokens, "error": outcome.error}
    if timing is not None:
        play = simulate_playback(timing.audio_times, timing.audio_durations, prebuffer_s)
        out.update({
            "ttft_ms": None if timing.ttft_s is None else timing.ttft_s * 1000,
            "ttfp_ms": None if timing.ttfp_s is None else timing.ttfp_s * 1000,
            "rtf": timing.rtf, "audio_seconds": timing.audio_seconds,
            "underruns": play.underruns, "underrun_s": play.underrun_s,
            "timeline_s": {"text": timing.text_times, "audio": timing.audio_times,
                           "audio_durations": timing.audio_durations, "done": timing.done},
        })
    return _jsonable(out)


def to_json(report: BenchReport) -> dict:
    out = {"schema": SCHEMA}
    for f in dataclasses.fields(report):
        if f.name in ("requests", "stage_times"):
            continue
        out[f.name] = _jsonable(getattr(report, f.name))
    out["stage_times"] = [
        {"system": system.value, "concurrency": level, "wall_s": report.level_wall_s(system, level),
         "stages": {name: _jsonable(times.to_json()) for name, times in stages.items()}}
        for (system, level), stages in report.stage_times.items()]
    out["machine"]["label"] = report.machine.label
    if report.floor is not None:
        for sample, raw in zip(report.floor.samples, out["floor"]["samples"]):
            raw["total_ms"] = round(sample.total_ms, 6)
    prebuffer_s = report.config.prebuffer_ms / 1000
    out["requests"] = [_request_json(r, prebuffer_s) for r in report.requests]
    return out


def write_json(report: BenchReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(report), indent=1) + "\n")


# Terminal table.

STAGE_COLUMNS = ("stage", "conc", "steps", "batch", "step ms", "busy %wall", "forward", "engine py", "commands",
                 "wire", "grpc+handlers", "cpu wait %wall")


def _stage_cells(name: str, level: int, times: StageTimes, wall_s: float) -> tuple[str, ...]:
    shares = times.shares()
    pct = lambda key: f"{100 * shares[key]:.0f}%"  # noqa: E731
    batch = times.batch_sum / times.batch_steps if times.batch_steps else None
    step_ms = 1000 * times.step_s / times.steps if times.steps else None
    return (name, str(level), f"{times.steps:.0f}", _num(batch, 1), _num(step_ms, 1),
            _num(100 * times.busy_s / wall_s if wall_s else None, 0), pct("model forward"), pct("engine python"),
            pct("commands"), pct("wire (de)serialization"), pct("grpc + handlers"),
            _num(100 * times.cpu_wait_s / wall_s if wall_s else None, 0))


def bottleneck(report: BenchReport, system: System = System.PIPELINE) -> tuple[str, int, StageTimes, float] | None:
    """The stage whose engine thread was busiest (share of the wall) at the highest concurrency."""
    levels = sorted(level for s, level in report.stage_times if s is system)
    if not levels:
        return None
    level = levels[-1]
    wall = report.level_wall_s(system, level)
    stages = report.stage_times[(system, level)]
    if not stages or not wall:
        return None
    name = max(stages, key=lambda n: stages[n].busy_s + stages[n].wire_s + stages[n].handlers_cpu_s)
    return name, level, stages[name], wall


def render_stage_times(report: BenchReport) -> list[str]:
    rows = []
    for (system, level), stages in sorted(report.stage_times.items(), key=lambda kv: (kv[0][1], kv[0][0].value)):
        if system is not System.PIPELINE:
            continue
        wall = report.level_wall_s(system, level)
        rows += [_stage_cells(name, level, times, wall) for name, times in sorted(stages.items())]
    if not rows:
        return []
    lines = ["", "pipeline stages: where the time goes (stage metrics; shares of engine-thread busy time plus "
                 "off-thread CPU)"]
    lines += _grid(STAGE_COLUMNS, rows)
    found = bottleneck(report)
    if found is not None:
        name, level, times, wall = found
        shares = times.shares()
        top = max(shares, key=shares.get)
        lines.append(f"  bottleneck at concurrency {level}: {name}, busy {100 * times.busy_s / wall:.0f}% of the "
                     f"wall; its largest part: {top} ({100 * shares[top]:.0f}%)")
    lines.append("  forward = model forwards incl. their module dispatch; engine py = scheduling, sampling, "
                 "bookkeeping; commands = handler inputs applied on the engine thread; wire = tensor/audio "
                 "encoding; grpc+handlers = the rest of the process's CPU; cpu wait = seconds its threads were "
                 "ready to run but had no CPU, summed over threads (above 100: several waited at once; "
                 "the CPU is oversubscribed)")
    return lines

def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _trio(p: Percentiles, digits: int = 0) -> str:
    return "/".join(_num(v, digits) for v in (p.p50, p.p90, p.p99))


COLUMNS = ("system", "conc", "n", "err", "TTFT ms p50/p90/p99", "TTFP ms p50/p90/p99", "RTF p50/p90/p99",
           "req/s", "audio s/s", "underruns/req", "gap s/req", "TTFP/floor")


def _result_cells(row: ResultRow) -> tuple[str, ...]:
    s = row.summary
    c = s.continuity
    return (row.system.value, str(row.concurrency), str(s.requests), str(s.errors), _trio(s.ttft_ms),
            _trio(s.ttfp_ms), _trio(s.rtf, 2), _num(s.req_per_s, 2), _num(s.audio_s_per_s, 2),
            _num(c.underruns_per_request.mean, 2), _num(c.underrun_s_per_request.mean, 3),
            _num(row.ttfp_over_floor, 1))


def _grid(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def fmt(cells: tuple[str, ...]) -> str:  # first column left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]


def _burst_cell(report: BenchReport, level: int, floor_ms: float) -> str:
    row = report.row(System.PIPELINE, level)
    ttfp = row.summary.ttfp_ms.p50 if row is not None else None
    return f"c={level} {floor_ms:.0f} ms" + (f" (pipeline TTFP p50 = {ttfp / floor_ms:.1f}x)" if ttfp else "")


def render_table(report: BenchReport) -> str:
    cfg = report.config
    lines = [
        f"omni-bench  {report.checkpoint_name} (preset {cfg.preset}) on {report.machine.label} (torch {report.machine.torch}, "
        f"{cfg.threads} thread(s) per process, device {cfg.device} {cfg.dtype})",
        f"  {len(report.prompts)} prompts, thinker {cfg.max_new_tokens} / talker {cfg.talker_max_new_tokens} max "
        f"new tokens, greedy; {cfg.rounds} round(s) per level; load average at start "
        f"{'/'.join(str(x) for x in report.machine.load_average)}",
    ]
    f = report.floor
    if f is not None:
        lines.append(
            f"  first-chunk floor ({f.first_chunk_frames} frames, in-process, median of {len(f.samples)}): "
            f"{f.floor_ms:.0f} ms = thinker prefill {f.thinker_prefill_ms:.0f} + decode {f.thinker_decode_ms:.0f}"
            f" + talker prefill {f.talker_prefill_ms:.0f} + decode {f.talker_decode_ms:.0f} + code2wav "
            f"{f.code2wav_ms:.0f} (prompt building {f.prompt_ms:.0f} ms, not counted)")
    for system, processes in report.exact_kernels.items():
        cells = "; ".join(f"{name}: " + ", ".join(f"{op} {path}" for op, path in ops.items())
                          for name, ops in processes.items())
        lines.append(f"  exact kernels ({system}): {cells}")
    if report.burst_floor:
        cells = ", ".join(_burst_cell(report, n, ms) for n, ms in sorted(report.burst_floor.items()))
        lines.append("  burst floor (n requests arriving together, in-process on one thread, the engines batching "
                     f"them; median first audio): {cells}")
    lines.append("")
    rows = sorted(report.results, key=lambda r: (r.concurrency, list(System).index(r.system)))
    lines += _grid(COLUMNS, [_result_cells(r) for r in rows])
    if report.ratios:
        lines.append("")
        header = ("system / baseline", "conc", "TTFT p50", "TTFP p50", "RTF p50", "req/s", "audio s/s")
        lines += _grid(header, [(f"{r.system.value} / {r.baseline.value}", str(r.concurrency), _num(r.ttft_p50, 2),
                                 _num(r.ttfp_p50, 2),
                                 _num(r.rtf_p50, 2), _num(r.req_per_s, 2), _num(r.audio_s_per_s, 2))
                                for r in report.ratios])
    if report.gateway_cost:
        lines.append("")
        header = ("gateway vs pipeline", "conc", "+TTFT ms p50", "+TTFP ms p50", "req/s", "audio s/s")
        lines += _grid(header, [("gateway", str(r.concurrency), _num(r.added_ttft_ms, 1), _num(r.added_ttfp_ms, 1),
                                 _num(r.req_per_s, 2), _num(r.audio_s_per_s, 2)) for r in report.gateway_cost])
    lines += render_stage_times(report)
    for skip in report.skipped:
        where = "all levels" if skip.concurrency is None else f"concurrency {skip.concurrency}"
        lines.append(f"  skipped {skip.system.value} at {where}: {skip.reason}")
    loads = [b.load_1m for b in report.blocks if b.load_1m is not None]
    if loads:
        lines.append(f"  1-minute load average at the end of each block: {min(loads):.1f} to {max(loads):.1f} on "
                     f"{report.machine.usable_cores} cores (the run itself adds about 1 in reference blocks, up to 4 "
                     f"in pipeline blocks; more is other work)")
    lines.append("  reference rows: TTFT = TTFP = whole-response time (generate streams nothing).")
    lines.append(f"  total {report.wall_s:.0f} s")
    return "\n".join(lines)
