"""The device benchmark's results (bench/device_bench.py): per-request timelines, each level's
figures, the stages' and the GPU's view of it, and the JSON, markdown and plot made of them.

What each figure means (docs/gpu.md, "Device check" has the same list):
- TTFT / TTFP: request sent -> first text delta / first audio chunk, at the client.
- RTF: (last audio chunk - request sent) / seconds of audio; the TTFP is in it.
- Streaming RTF: (last chunk - first chunk) / seconds of audio after the first chunk (below 1: a
  player that started at the first chunk never runs dry); the steady state's figure.
- req/s and audio s/s: completed requests and seconds of audio per wall second of the level (first
  send to last completion); audio s/s per GPU divides by the GPUs the stack ran on.
- Per stage, over the level (differences of two scrapes of its metrics): engine steps, mean step
  and forward time, mean batch, the forward's share of the busy engine thread, the busy share of
  the wall time; its queue depth and running batch sampled every interval.
- GPU: NVML utilisation (the share of time any kernel ran) and memory, sampled every interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bench.level_sampler import Gauge, GpuGauges, LevelSamples, StageGauges
from bench.metrics import RequestTiming, percentile, simulate_playback
from bench.plot import Line, plot_levels
from bench.stage_metrics import StageTimes


@dataclass(frozen=True)
class Timeline:
    """One request, in seconds: `sent_s` from the level's start, every other time from its send."""

    request_id: str
    sent_s: float
    text_times_s: tuple[float, ...] = ()
    audio_times_s: tuple[float, ...] = ()
    audio_chunk_s: tuple[float, ...] = ()  # seconds of audio in each chunk, same order
    done_s: float | None = None
    error: str | None = None

    @property
    def timing(self) -> RequestTiming | None:
        if self.error is not None or self.done_s is None:
            return None
        return RequestTiming(self.text_times_s, self.audio_times_s, self.audio_chunk_s, self.done_s)


@dataclass(frozen=True)
class StageLevel:
    """One stage process over one level (the module note)."""

    steps: int
    step_ms_mean: float | None
    forward_ms_mean: float | None  # model forwards per step (the timer waits for the GPU on cuda)
    batch_mean: float | None
    prefills_mean: float | None  # prompts (or chunks) an LM step that prefilled took together
    forward_share: float | None  # forward / (forward + engine Python + commands)
    busy_share: float | None  # the engine thread's busy time / the level's wall time
    queue_depth: Gauge  # sampled through the level
    running: Gauge

    @classmethod
    def of(cls, times: StageTimes, gauges: StageGauges | None, wall_s: float) -> StageLevel:
        def per(value: float, count: float, scale: float = 1.0) -> float | None:
            return round(value / count * scale, 3) if count > 0 else None

        empty = Gauge(None, None, 0)
        return cls(steps=int(times.steps), step_ms_mean=per(times.step_s, times.steps, 1000),
                   forward_ms_mean=per(times.forward_s, times.steps, 1000),
                   batch_mean=per(times.batch_sum, times.batch_steps),
                   prefills_mean=per(times.prefills, times.prefill_steps), forward_share=per(times.forward_s, times.busy_s),
                   busy_share=per(times.busy_s, wall_s),
                   queue_depth=gauges.queue_depth if gauges else empty, running=gauges.running if gauges else empty)


@dataclass
class LevelResult:
    graphs: str  # the --cuda-graphs value of the stages
    concurrency: int  # closed loop: requests kept in flight; open loop: 0
    requests: int
    sharing: str = "none"  # the mode's --gpu-sharing (a mode whose MPS did not start measures nothing)
    loop: str = "closed"  # closed: `concurrency` clients back to back; open: Poisson arrivals at `rate_per_s`
    rate_per_s: float | None = None  # open loop: the offered arrival rate
    errors: int = 0
    wall_s: float = 0.0
    ttfp_ms_p50: float | None = None
    ttfp_ms_p99: float | None = None
    ttft_ms_p50: float | None = None
    ttft_ms_p99: float | None = None
    rtf_p50: float | None = None
    rtf_p99: float | None = None
    streaming_rtf_p50: float | None = None
    streaming_rtf_p99: float | None = None
    underrun_requests: int | None = None  # requests whose player (started at the first chunk) ran dry
    audio_s_p50: float | None = None  # seconds of audio per request
    req_per_s: float | None = None
    audio_s_per_s: float | None = None
    audio_s_per_s_per_gpu: float | None = None
    skipped: str | None = None  # why the level did not run
    first_error: str | None = None
    stages: dict[str, StageLevel] = field(default_factory=dict)  # process name -> its view of the level
    gpu_source: str | None = None  # nvml, nvidia-smi, or why there are none (bench/level_sampler.py)
    gpus: list[GpuGauges] = field(default_factory=list)
    timelines: list[Timeline] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.loop == "closed" else f"{self.rate_per_s:g}/s"


@dataclass
class ModeResult:
    graphs: str
    sharing: str = "none"  # asked for
    mps: bool = False  # MPS in use (asked for and started)
    startup_s: float | None = None
    warmup_s: float | None = None
    gpu_memory: str | None = None  # nvidia-smi after start-up
    error: str | None = None  # the stack did not start, or broke


@dataclass
class Report:
    config: dict
    machine: dict
    modes: list[ModeResult] = field(default_factory=list)
    levels: list[LevelResult] = field(default_factory=list)
    wall_s: float = 0.0


def summarize(row: LevelResult, timelines: list[Timeline], wall_s: float, gpus: int,
              stages: dict[str, StageTimes], samples: LevelSamples | None) -> LevelResult:
    """`row` (its mode, loop and level filled in) with the level's figures."""
    timings = [t.timing for t in timelines if t.timing is not None and t.audio_times_s]
    errors = [t.error or "no audio" for t in timelines if t.timing is None or not t.audio_times_s]
    ms = lambda xs: [x * 1000 for x in xs if x is not None]  # noqa: E731
    ttfp, ttft = ms([t.ttfp_s for t in timings]), ms([t.ttft_s for t in timings])
    rtf = [t.rtf for t in timings if t.rtf is not None]
    streaming = [t.streaming_rtf for t in timings if t.streaming_rtf is not None]
    audio = sum(t.audio_seconds for t in timings)
    row.requests, row.errors, row.wall_s = len(timelines), len(errors), round(wall_s, 3)
    row.ttfp_ms_p50, row.ttfp_ms_p99 = percentile(ttfp, 50), percentile(ttfp, 99)
    row.ttft_ms_p50, row.ttft_ms_p99 = percentile(ttft, 50), percentile(ttft, 99)
    row.rtf_p50, row.rtf_p99 = percentile(rtf, 50), percentile(rtf, 99)
    row.streaming_rtf_p50, row.streaming_rtf_p99 = percentile(streaming, 50), percentile(streaming, 99)
    row.underrun_requests = sum(simulate_playback(t.audio_times, t.audio_durations).underruns > 0 for t in timings)
    row.audio_s_p50 = percentile([t.audio_seconds for t in timings], 50)
    row.req_per_s = len(timings) / wall_s if wall_s > 0 else None
    row.audio_s_per_s = audio / wall_s if wall_s > 0 else None
    row.audio_s_per_s_per_gpu = row.audio_s_per_s / gpus if row.audio_s_per_s is not None and gpus > 0 else None
    row.first_error = errors[0] if errors else None
    row.stages = {name: StageLevel.of(times, samples.stages.get(name) if samples else None, wall_s)
                  for name, times in stages.items()}
    if samples is not None:
        row.gpu_source, row.gpus = samples.gpu_source, samples.gpus
    row.timelines = timelines
    return row


def device_name(report: Report) -> str:
    """The first accelerator bench/machine.py found, else the --device the stages ran on."""
    return (report.machine.get("accelerators") or [report.config["device"]])[0]


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_markdown(report: Report, path: Path) -> None:
    cfg = report.config
    frames = cfg["talker_tokens"] - 1
    lines = [f"{cfg['label']}, random weights, {cfg['dtype']} on {device_name(report)}; "
             f"thinker {cfg['thinker_tokens']} tokens, talker {cfg['talker_tokens']} tokens "
             f"({frames} frames, {frames * 0.08:.2f} s of audio) per request; {cfg['gpus']} GPU(s). "
             "Closed loop: c requests in flight; open loop: Poisson arrivals at the rate.", "",
             "| graphs | sharing | load | requests | TTFP p50 / p99 (ms) | streaming RTF p50 / p99 | RTF p50 / p99 "
             "| req/s | audio s/s/GPU | GPU util | errors |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report.levels:
        if r.skipped:
            lines.append(f"| {r.graphs} | {r.sharing} | {r.label} | - | skipped: {r.skipped} | | | | | | |")
            continue
        util = ", ".join(f"{fmt(g.util_pct.mean)} %" for g in r.gpus) or "-"
        lines.append(f"| {r.graphs} | {r.sharing} | {r.label} | {r.requests} | {fmt(r.ttfp_ms_p50)} / {fmt(r.ttfp_ms_p99)} "
                     f"| {fmt(r.streaming_rtf_p50, 3)} / {fmt(r.streaming_rtf_p99, 3)} | {fmt(r.rtf_p50, 3)} / "
                     f"{fmt(r.rtf_p99, 3)} | {fmt(r.req_per_s, 2)} | {fmt(r.audio_s_per_s_per_gpu, 2)} | {util} "
                     f"| {r.errors} |")
    lines += ["", "Per stage (mean step and forward ms, mean batch, forward share of the busy engine thread, "
              "busy share of the wall time, queue depth mean / max, prompts per prefilling step):", "",
              "| graphs | sharing | load | stage | steps | step ms | forward ms | batch | forward share | busy | queue "
              "| prefills |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report.levels:
        for name, s in r.stages.items():
            lines.append(f"| {r.graphs} | {r.sharing} | {r.label} | {name} | {s.steps} | {fmt(s.step_ms_mean, 2)} | "
                         f"{fmt(s.forward_ms_mean, 2)} | {fmt(s.batch_mean, 1)} | {fmt(s.forward_share, 2)} | "
                         f"{fmt(s.busy_share, 2)} | {fmt(s.queue_depth.mean, 1)} / {fmt(s.queue_depth.max)} | "
                         f"{fmt(s.prefills_mean, 1)} |")
    for m in report.modes:
        fallback = "" if m.mps or m.sharing == "none" else " (MPS did not start)"
        lines.append(f"\n- graphs {m.graphs}, sharing {m.sharing}{fallback}: "
                     f"start-up {fmt(m.startup_s, 1)} s, warm-up {fmt(m.warmup_s, 1)} s"
                     + (f", GPU memory {m.gpu_memory}" if m.gpu_memory else "") + (f", error: {m.error}" if m.error else ""))
    path.write_text("\n".join(lines) + "\n")


def write_plot(report: Report, path: Path) -> None:
    lines = []
    colours = iter(("tab:blue", "tab:orange", "tab:gray", "tab:green", "tab:purple", "tab:red"))
    for mode in report.modes:
        rows = sorted((r for r in report.levels if r.graphs == mode.graphs and r.sharing == mode.sharing
                       and r.loop == "closed" and r.ttfp_ms_p50 is not None), key=lambda r: r.concurrency)
        if rows:
            lines.append(Line(f"graphs {mode.graphs}, {'MPS' if mode.mps else 'no MPS'}", next(colours), "o",
                              [r.concurrency for r in rows], [r.ttfp_ms_p50 for r in rows],
                              [r.ttfp_ms_p99 for r in rows], [r.req_per_s for r in rows], tail="p99"))
    cfg = report.config
    plot_levels(lines, path, f"omni-serve: {cfg['label']}, random weights, {cfg['dtype']}, {device_name(report)}")
