"""The device benchmark: the whole stack at full size on one GPU, CUDA graphs on and off.

For each graphs mode it starts code2wav, talker, thinker and the router as processes (all on the
same device, random weights, bfloat16), sends one warm-up request, then at each concurrency level
N runs a closed loop of N client threads over a fixed number of requests, and measures from the
client side (services/tools/client.py `collect`): TTFP (first audio chunk), TTFT, RTF (last audio chunk /
seconds of audio) and completed requests per second. Results are written after every level
(device_bench.json, then device_bench.png and device_bench.md), so a run cut short keeps what it
measured. Every phase is bounded by the overall deadline; a level that would not fit is skipped
and recorded as such.

Run by bench/device_check.sh; `omni-bench` is not used because it loads the transformers
reference model from safetensors in its own process, which a weightless full-size folder lacks.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.loop import closed_loop
from bench.machine import describe_machine
from bench.metrics import percentile
from bench.plot import Line, plot_levels
from services.code2wav.config import Decoder
from services.tools.client import build_request, collect, connect
from services.tools.launcher import Stack, StackOptions

PROMPTS = (  # text only: the talker and code2wav see the same work for every prompt
    "Hello! How are you today?",
    "Tell me a short story about a small robot.",
    "What is the weather like? Please answer briefly.",
    "Describe a journey of a thousand miles.",
)


@dataclass(frozen=True)
class Sample:
    ttfp_s: float | None
    ttft_s: float | None
    rtf: float | None
    audio_s: float
    error: str | None = None


@dataclass
class LevelResult:
    graphs: str  # the --cuda-graphs value of the stages
    concurrency: int
    requests: int
    errors: int = 0
    wall_s: float = 0.0
    ttfp_ms_p50: float | None = None
    ttfp_ms_p99: float | None = None
    ttft_ms_p50: float | None = None
    rtf_p50: float | None = None
    rtf_p99: float | None = None
    req_per_s: float | None = None
    audio_s_per_s: float | None = None
    skipped: str | None = None  # why the level did not run
    first_error: str | None = None


@dataclass
class ModeResult:
    graphs: str
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


def summarize(graphs: str, level: int, samples: list[Sample], wall_s: float) -> LevelResult:
    ok = [s for s in samples if s.error is None]
    ms = lambda xs: [x * 1000 for x in xs if x is not None]  # noqa: E731
    errors = [s.error for s in samples if s.error is not None]
    return LevelResult(
        graphs=graphs, concurrency=level, requests=len(samples), errors=len(errors), wall_s=round(wall_s, 3),
        ttfp_ms_p50=percentile(ms([s.ttfp_s for s in ok]), 50), ttfp_ms_p99=percentile(ms([s.ttfp_s for s in ok]), 99),
        ttft_ms_p50=percentile(ms([s.ttft_s for s in ok]), 50),
        rtf_p50=percentile([s.rtf for s in ok if s.rtf is not None], 50),
        rtf_p99=percentile([s.rtf for s in ok if s.rtf is not None], 99),
        req_per_s=len(ok) / wall_s if wall_s > 0 else None,
        audio_s_per_s=sum(s.audio_s for s in ok) / wall_s if wall_s > 0 else None,
        first_error=errors[0] if errors else None,
    )


def one_request(stub, request, timeout_s: float) -> Sample:
    import grpc

    try:
        result = collect(stub, request, timeout=timeout_s)
    except grpc.RpcError as exc:
        return Sample(None, None, None, 0.0, f"{exc.code().name}: {exc.details()}")
    ttfp = result.ttfp_ms / 1000 if result.ttfp_ms is not None else None
    ttft = result.ttft_ms / 1000 if result.ttft_ms is not None else None
    if ttfp is None:
        return Sample(None, ttft, None, 0.0, "no audio")
    return Sample(ttfp, ttft, result.rtf, result.audio_seconds)


def run_level(stub, requests: list, concurrency: int, timeout_s: float) -> tuple[list[Sample], float]:
    """`concurrency` clients, each sending its next request when the previous one ended."""
    return closed_loop(requests, concurrency, lambda request: one_request(stub, request, timeout_s),
                       lambda exc: Sample(None, None, None, 0.0, f"{type(exc).__name__}: {exc}"))


def gpu_memory() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


class DeviceBench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.started = time.monotonic()
        self.deadline = self.started + args.deadline_s
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.report = Report(config={k: v for k, v in vars(args).items()}, machine=asdict(describe_machine()))

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f} s] {message}", flush=True)

    def stage_args(self, graphs: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        a = self.args
        common = ("--device", a.device, "--dtype", a.dtype, "--random-weights", "--cuda-graphs", graphs,
                  "--graph-buckets", a.buckets)
        lm = ("--max-batch-size", str(a.max_batch), "--num-slots", str(a.max_batch),
              "--max-model-len", str(a.max_model_len))
        code2wav = common + ("--decoder", a.code2wav_decoder)  # the window decoder captures the grid's windows
        return common + lm, common + lm + ("--first-chunk-frames", "4"), code2wav

    def requests(self, n: int) -> list:
        return [build_request(PROMPTS[i % len(PROMPTS)], max_new_tokens=self.args.thinker_tokens,
                              talker_max_new_tokens=self.args.talker_tokens, request_id=f"bench-{i}")
                for i in range(n)]

    def write(self) -> None:
        self.report.wall_s = round(time.monotonic() - self.started, 1)
        (self.out / "device_bench.json").write_text(json.dumps(asdict(self.report), indent=2) + "\n")

    def run_mode(self, graphs: str, modes_left: int) -> None:
        mode = ModeResult(graphs)
        self.report.modes.append(mode)
        budget = self.left() / modes_left  # this mode's share of the time left
        mode_deadline = time.monotonic() + budget
        thinker, talker, code2wav = self.stage_args(graphs)
        stack = Stack(StackOptions(checkpoint=self.args.checkpoint, port=0, threads=self.args.threads,
                                   thinker_args=thinker, talker_args=talker, code2wav_args=code2wav,
                                   startup_timeout_s=max(30.0, min(self.args.startup_timeout_s, budget * 0.7)),
                                   device=self.args.device))
        self.say(f"graphs {graphs}: starting the stack (budget {budget:.0f} s)")
        t = time.monotonic()
        try:
            stack.start()
        except Exception as exc:  # noqa: BLE001 - record, go on with the next mode
            mode.error = f"start: {type(exc).__name__}: {exc}"
            self.say(mode.error)
            self.write()
            return
        if self.args.pids_file:  # the shell's clean-up stops these if this process is killed
            Path(self.args.pids_file).write_text(" ".join(str(p.popen.pid) for p in stack.processes.values()) + "\n")
        try:
            mode.startup_s = round(time.monotonic() - t, 1)
            mode.gpu_memory = gpu_memory()
            self.say(f"graphs {graphs}: stack up in {mode.startup_s} s; GPU memory: {mode.gpu_memory}")
            self.measure(stack.target, mode, mode_deadline)
        except Exception as exc:  # noqa: BLE001
            mode.error = f"run: {type(exc).__name__}: {exc}"
            self.say(mode.error)
        finally:
            t = time.monotonic()
            stack.stop(grace_s=5.0)
            if self.args.pids_file:
                Path(self.args.pids_file).write_text("")
            self.say(f"graphs {graphs}: stack stopped ({time.monotonic() - t:.1f} s)")
            self.write()

    def measure(self, target: str, mode: ModeResult, deadline: float) -> None:
        """The warm-up, then a closed loop at each concurrency level that can finish by `deadline`."""
        graphs = mode.graphs
        channel, stub = connect(target)
        t = time.monotonic()
        warm = [one_request(stub, r, max(5.0, deadline - time.monotonic())) for r in self.requests(2)]
        mode.warmup_s = round(time.monotonic() - t, 1)
        self.say(f"graphs {graphs}: warm-up {mode.warmup_s} s ({[w.error or 'ok' for w in warm]})")
        per_request = max(mode.warmup_s / 2, 0.5)  # a lone request's time, for skipping levels
        for level in self.args.levels:
            n = max(level, self.args.min_requests)
            left = deadline - time.monotonic()
            # A closed loop of n requests at concurrency `level` takes about n / level lone
            # requests' time once batched; skip a level that clearly cannot finish.
            if left < max(10.0, per_request * n / level):
                self.report.levels.append(LevelResult(graphs, level, n, skipped=f"time: {left:.0f} s left"))
                self.say(f"graphs {graphs}: c={level} skipped ({left:.0f} s left)")
                continue
            self.say(f"graphs {graphs}: c={level}, {n} requests ...")
            samples, wall = run_level(stub, self.requests(n), level, timeout_s=left)
            row = summarize(graphs, level, samples, wall)
            self.report.levels.append(row)
            self.say(f"graphs {graphs}: c={level}: ttfp p50 {fmt(row.ttfp_ms_p50)} ms p99 {fmt(row.ttfp_ms_p99)} ms, "
                     f"rtf p50 {fmt(row.rtf_p50, 3)}, {fmt(row.req_per_s, 2)} req/s, errors {row.errors}"
                     + (f" ({row.first_error})" if row.first_error else ""))
            self.write()
        channel.close()

    def run(self) -> Report:
        modes = self.args.graphs
        for i, graphs in enumerate(modes):
            if self.left() < 30:
                self.report.modes.append(ModeResult(graphs, error=f"time: {self.left():.0f} s left"))
                continue
            self.run_mode(graphs, len(modes) - i)
        self.write()
        write_markdown(self.report, self.out / "device_bench.md")
        try:
            write_plot(self.report, self.out / "device_bench.png")
        except Exception as exc:  # noqa: BLE001 - the JSON is what matters
            self.say(f"plot: {type(exc).__name__}: {exc}")
        return self.report


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_markdown(report: Report, path: Path) -> None:
    cfg = report.config
    lines = [f"{cfg['label']}, random weights, {cfg['dtype']} on {report.machine.get('gpu') or cfg['device']}; "
             f"thinker {cfg['thinker_tokens']} tokens, talker {cfg['talker_tokens']} tokens "
             f"({cfg['talker_tokens'] - 1} frames, {(cfg['talker_tokens'] - 1) * 0.08:.2f} s of audio) per request.", "",
             "| CUDA graphs | concurrency | requests | TTFP p50 (ms) | TTFP p99 (ms) | RTF p50 | RTF p99 | req/s | errors |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report.levels:
        if r.skipped:
            lines.append(f"| {r.graphs} | {r.concurrency} | - | skipped: {r.skipped} | | | | | |")
            continue
        lines.append(f"| {r.graphs} | {r.concurrency} | {r.requests} | {fmt(r.ttfp_ms_p50)} | {fmt(r.ttfp_ms_p99)} | "
                     f"{fmt(r.rtf_p50, 3)} | {fmt(r.rtf_p99, 3)} | {fmt(r.req_per_s, 2)} | {r.errors} |")
    for m in report.modes:
        lines.append(f"\n- graphs {m.graphs}: start-up {fmt(m.startup_s, 1)} s, warm-up {fmt(m.warmup_s, 1)} s"
                     + (f", GPU memory {m.gpu_memory}" if m.gpu_memory else "") + (f", error: {m.error}" if m.error else ""))
    path.write_text("\n".join(lines) + "\n")


def write_plot(report: Report, path: Path) -> None:
    lines = []
    for graphs, colour in (("on", "tab:blue"), ("off", "tab:gray"), ("auto", "tab:green")):
        rows = sorted((r for r in report.levels if r.graphs == graphs and r.ttfp_ms_p50 is not None),
                      key=lambda r: r.concurrency)
        if rows:
            lines.append(Line(f"graphs {graphs}", colour, "o", [r.concurrency for r in rows],
                              [r.ttfp_ms_p50 for r in rows], [r.ttfp_ms_p99 for r in rows],
                              [r.req_per_s for r in rows], tail="p99"))
    cfg = report.config
    plot_levels(lines, path, f"omni-serve: {cfg['label']}, random weights, {cfg['dtype']}, "
                             f"{report.machine.get('gpu') or cfg['device']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device_bench", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a folder from omni-tiny-checkpoint --full-size --no-weights")
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="Full-size Qwen3-Omni-30B-A3B layout", help="what the folder holds, for the table")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--graphs", default="on,off", help="--cuda-graphs values to run, in order (default on,off)")
    p.add_argument("--levels", default="1,16,64", help="concurrency levels (default 1,16,64)")
    p.add_argument("--min-requests", type=int, default=4, help="requests per level: max(level, this)")
    p.add_argument("--thinker-tokens", type=int, default=16)
    p.add_argument("--talker-tokens", type=int, default=40, help="N tokens give N - 1 frames (80 ms each)")
    p.add_argument("--max-batch", type=int, default=64, help="thinker/talker --max-batch-size and --num-slots")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--buckets", default="1,2,4,8,16,32,64")
    p.add_argument("--code2wav-decoder", choices=list(Decoder), default=Decoder.INCREMENTAL.value,
                   help="code2wav's --decoder (default: the service's, incremental, which captures no graphs; "
                        "window: its chunk windows are captured and replayed in the graphs-on mode)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per stage (0: cores / 3)")
    p.add_argument("--startup-timeout-s", type=float, default=180.0)
    p.add_argument("--deadline-s", type=float, default=420.0, help="everything, both modes, ends by then")
    p.add_argument("--pids-file", help="write the running stage processes' ids here (for the caller's clean-up)")
    args = p.parse_args(argv)
    # SIGTERM (the caller's timeout) unwinds like Ctrl-C, so the running stack is stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    args.graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
    args.levels = sorted({int(x) for x in args.levels.split(",") if x.strip()})
    report = DeviceBench(args).run()
    print((Path(args.out) / "device_bench.md").read_text())
    ran = [r for r in report.levels if not r.skipped]
    return 0 if ran and all(r.errors < r.requests for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
