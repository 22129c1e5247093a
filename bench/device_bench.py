"""The device benchmark: the whole stack at full size on one GPU, per mode (CUDA graphs on or off,
the GPU shared by time-slicing or through MPS).

For each mode it starts code2wav, talker, thinker and the router as processes (all on the same
device, random weights, bfloat16, `--gpu-sharing` as the mode says), sends two warm-up requests,
then runs its levels:
- closed loop, at each concurrency c of --levels: c clients back to back, so c requests are in
  flight, over max(--requests-per-client x c, --min-requests) requests (3c at least: the first
  and last c run beside a part-full batch, the middle c beside a full one);
- open loop, at each rate of --rates: --open-requests requests sent at seeded Poisson arrival
  times, whatever is in flight (the offered load does not wait for the stack).
Each level keeps every request's timeline (client side, services/tools/client.py `collect`), the
stages' metrics scraped before and after it (steps, step and forward time, batch) and sampled
through it (queue depth, running batch), and the GPU's utilisation and memory sampled through it
(bench/level_sampler.py); bench/device_report.py computes and writes the figures (TTFP, RTF and
streaming RTF apart, audio seconds per second per GPU). Results are written after every level
(device_bench.json, at the end device_bench.md and .png), so a run cut short keeps what it
measured. Every phase is bounded by the overall deadline, each mode by its share of it: a level
that would not fit is skipped and recorded as such, a request due past its mode's end is not sent
(an error in its level). `--long-answer` asks for 300 talker frames (24 s of audio) a request, for
the steady state a short answer never reaches.

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
from dataclasses import asdict
from pathlib import Path

from bench.device_report import LevelResult, ModeResult, Report, Timeline, fmt, summarize, write_markdown, write_plot
from bench.level_sampler import LevelSampler
from bench.loop import closed_loop, closed_loop_requests, open_loop
from bench.machine import describe_machine
from bench.stage_metrics import StageScraper, interval
from services.base.stages import SPEECH_SAMPLE_RATE, Stage
from services.code2wav.config import Decoder
from services.tools.client import build_request, collect, connect
from services.tools.gpu_sharing import GpuSharing, MpsPercent
from services.tools.launcher import Stack, StackOptions, free_port_block

PROMPTS = (  # text only: the talker and code2wav see the same work for every prompt
    "Hello! How are you today?",
    "Tell me a short story about a small robot.",
    "What is the weather like? Please answer briefly.",
    "Describe a journey of a thousand miles.",
)
LONG_ANSWER = (48, 301, 512)  # --long-answer: thinker tokens, talker tokens (300 frames, 24 s), least --max-model-len


def one_request(stub, request, deadline: float, level_start: float) -> Timeline:
    """One request's timeline; a failed call is a timeline with its error. `deadline` (monotonic)
    bounds the call; past it the request is not sent (an error: the level ran out of time)."""
    import grpc

    sent = time.perf_counter()
    timeout_s = deadline - time.monotonic()
    if timeout_s < 1.0:
        return Timeline(request.request_id, round(sent - level_start, 4), error="not sent: the mode's time ran out")
    try:
        result = collect(stub, request, timeout=timeout_s)
    except grpc.RpcError as exc:
        return Timeline(request.request_id, round(sent - level_start, 4), error=f"{exc.code().name}: {exc.details()}")
    since = lambda times: tuple(round(t - result.sent, 4) for t in times)  # noqa: E731
    rate = result.sample_rate or SPEECH_SAMPLE_RATE
    return Timeline(request.request_id, round(result.sent - level_start, 4), since(result.text_times),
                    since(result.audio_times), tuple(round(c.size / rate, 4) for c in result.audio_chunks),
                    round(time.perf_counter() - result.sent, 4))


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
        self.report = Report(config=dict(vars(args)), machine=asdict(describe_machine()))

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

    def requests(self, n: int, tag: str) -> list:
        return [build_request(PROMPTS[i % len(PROMPTS)], max_new_tokens=self.args.thinker_tokens,
                              talker_max_new_tokens=self.args.talker_tokens, request_id=f"{tag}-{i}")
                for i in range(n)]

    def write(self) -> None:
        self.report.wall_s = round(time.monotonic() - self.started, 1)
        (self.out / "device_bench.json").write_text(json.dumps(asdict(self.report), indent=1) + "\n")

    def run_mode(self, graphs: str, sharing: GpuSharing, modes_left: int) -> None:
        mode = ModeResult(graphs, sharing.value)
        self.report.modes.append(mode)
        budget = self.left() / modes_left  # this mode's share of the time left
        mode_deadline = time.monotonic() + budget
        thinker, talker, code2wav = self.stage_args(graphs)
        a = self.args
        stack = Stack(StackOptions(checkpoint=a.checkpoint, port=0, threads=a.threads, thinker_args=thinker,
                                   talker_args=talker, code2wav_args=code2wav, device=a.device,
                                   startup_timeout_s=max(30.0, min(a.startup_timeout_s, budget * 0.7)),
                                   metrics_base_port=free_port_block(), gpu_sharing=sharing,
                                   mps_percent=MpsPercent(a.mps_thinker_percent, a.mps_talker_percent,
                                                          a.mps_code2wav_percent)))
        name = f"graphs {graphs}, sharing {sharing}"
        self.say(f"{name}: starting the stack (budget {budget:.0f} s)")
        t = time.monotonic()
        try:
            stack.start()
        except Exception as exc:  # noqa: BLE001 - record, go on with the next mode
            mode.error = f"start: {type(exc).__name__}: {exc}"
            self.say(mode.error)
            self.write()
            return
        if a.pids_file:  # the shell's clean-up stops these if this process is killed
            Path(a.pids_file).write_text(" ".join(str(p.popen.pid) for p in stack.processes.values()) + "\n")
        try:
            mode.startup_s = round(time.monotonic() - t, 1)
            mode.mps = stack.mps is not None
            mode.gpu_memory = gpu_memory()
            self.say(f"{name}: stack up in {mode.startup_s} s; GPU memory: {mode.gpu_memory}")
            if sharing is GpuSharing.MPS and not mode.mps:
                mode.error = "MPS did not start (stack.log has the launcher's line): nothing measured"
                self.report.levels += [LevelResult(graphs, c, 0, sharing.value, skipped="MPS did not start")
                                       for c in a.levels]
            else:
                self.measure(stack, mode, mode_deadline)
        except Exception as exc:  # noqa: BLE001
            mode.error = f"run: {type(exc).__name__}: {exc}"
            self.say(mode.error)
        finally:
            t = time.monotonic()
            stack.stop(grace_s=5.0)
            if a.pids_file:
                Path(a.pids_file).write_text("")
            self.say(f"{name}: stack stopped ({time.monotonic() - t:.1f} s)")
            self.write()

    def measure(self, stack: Stack, mode: ModeResult, deadline: float) -> None:
        """The warm-up, then every closed-loop level and every open-loop rate that can finish by `deadline`."""
        channel, stub = connect(stack.target)
        scraper = StageScraper.for_stack(stack)
        t = time.monotonic()
        warm = [one_request(stub, r, max(deadline, t + 5.0), t) for r in self.requests(2, "warm")]
        mode.warmup_s = round(time.monotonic() - t, 1)
        self.say(f"graphs {mode.graphs}, sharing {mode.sharing}: warm-up {mode.warmup_s} s "
                 f"({[w.error or 'ok' for w in warm]})")
        per_request = max(mode.warmup_s / 2, 0.5)  # a lone request's time, for skipping levels
        a = self.args
        plan = [LevelResult(mode.graphs, c, closed_loop_requests(c, a.requests_per_client, a.min_requests),
                            mode.sharing) for c in a.levels]
        plan += [LevelResult(mode.graphs, 0, a.open_requests, mode.sharing, loop="open", rate_per_s=rate)
                 for rate in a.rates]
        for row in plan:
            left = deadline - time.monotonic()
            # A closed loop of n requests at concurrency c takes about n / c lone requests' time once
            # batched; an open loop its arrivals' span and one more request. Skip a level that clearly cannot finish.
            need = per_request * row.requests / row.concurrency if row.loop == "closed" else \
                row.requests / row.rate_per_s + per_request
            if left < max(10.0, need):
                row.skipped = f"time: {left:.0f} s left, about {need:.0f} s needed"
                self.report.levels.append(row)
                self.say(f"{row.label} skipped ({row.skipped})")
                continue
            self.say(f"graphs {mode.graphs}, sharing {mode.sharing}: {row.loop} loop {row.label}, {row.requests} requests ...")
            self.run_level(stub, scraper, row, deadline)
            self.report.levels.append(row)
            self.say(f"{row.label}: ttfp p50 {fmt(row.ttfp_ms_p50)} ms p99 {fmt(row.ttfp_ms_p99)} ms, streaming rtf p50 "
                     f"{fmt(row.streaming_rtf_p50, 3)} p99 {fmt(row.streaming_rtf_p99, 3)}, rtf p50 {fmt(row.rtf_p50, 3)}, "
                     f"{fmt(row.req_per_s, 2)} req/s, {fmt(row.audio_s_per_s_per_gpu, 2)} audio s/s/GPU, errors "
                     f"{row.errors}" + (f" ({row.first_error})" if row.first_error else ""))
            self.write()
        channel.close()

    def run_level(self, stub, scraper: StageScraper, row: LevelResult, deadline: float) -> None:
        requests = self.requests(row.requests, f"{row.graphs}-{row.sharing}-{row.label}")
        failed = lambda exc: Timeline("?", 0.0, error=f"{type(exc).__name__}: {exc}")  # noqa: E731
        before = scraper.snapshot()
        with LevelSampler(scraper.endpoints, self.args.sample_interval_s, gpu=self.args.device.startswith("cuda")) \
                as sampler:
            start = time.perf_counter()
            call = lambda request: one_request(stub, request, deadline, start)  # noqa: E731
            if row.loop == "closed":
                timelines, wall = closed_loop(requests, row.concurrency, call, failed)
            else:
                timelines, wall = open_loop(requests, row.rate_per_s, call, failed, seed=self.args.seed)
        summarize(row, timelines, wall, self.args.gpus, interval(before, scraper.snapshot()), sampler.result())

    def run(self) -> Report:
        modes = [(graphs, sharing) for graphs in self.args.graphs for sharing in self.args.gpu_sharing]
        for i, (graphs, sharing) in enumerate(modes):
            if self.left() < 30:
                self.report.modes.append(ModeResult(graphs, sharing.value, error=f"time: {self.left():.0f} s left"))
                continue
            self.run_mode(graphs, sharing, len(modes) - i)
        self.write()
        write_markdown(self.report, self.out / "device_bench.md")
        try:
            write_plot(self.report, self.out / "device_bench.png")
        except Exception as exc:  # noqa: BLE001 - the JSON is what matters
            self.say(f"plot: {type(exc).__name__}: {exc}")
        return self.report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.device_bench", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a folder from omni-tiny-checkpoint --full-size --no-weights")
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="Full-size Qwen3-Omni-30B-A3B layout", help="what the folder holds, for the table")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the stack runs on, for audio s/s per GPU (default 1)")
    p.add_argument("--graphs", default="on,off", help="--cuda-graphs values to run, in order (default on,off)")
    p.add_argument("--gpu-sharing", default="none",
                   help="--gpu-sharing values to run for each graphs value, in order, e.g. none,mps (default none)")
    for stage in Stage:
        p.add_argument(f"--mps-{stage}-percent", type=int, default=getattr(MpsPercent(), stage.value),
                       help=f"under MPS the {stage}'s active-thread percentage (default %(default)s)")
    p.add_argument("--levels", default="1,16,64", help="closed-loop concurrency levels (default 1,16,64)")
    p.add_argument("--requests-per-client", type=int, default=3,
                   help="a closed-loop level of c sends this many times c requests (default and least 3)")
    p.add_argument("--min-requests", type=int, default=4, help="and at least this many (default 4)")
    p.add_argument("--rates", default="", help="open-loop arrival rates, requests/s (default none)")
    p.add_argument("--open-requests", type=int, default=32, help="requests per open-loop rate (default 32)")
    p.add_argument("--seed", type=int, default=0, help="the open loop's arrival times")
    p.add_argument("--thinker-tokens", type=int, default=16)
    p.add_argument("--talker-tokens", type=int, default=40, help="N tokens give N - 1 frames (80 ms each)")
    p.add_argument("--long-answer", action="store_true",
                   help=f"thinker {LONG_ANSWER[0]} / talker {LONG_ANSWER[1]} tokens ({LONG_ANSWER[1] - 1} frames, "
                        f"{(LONG_ANSWER[1] - 1) * 0.08:.0f} s of audio) a request, --max-model-len at least {LONG_ANSWER[2]}: "
                        "the steady state")
    p.add_argument("--max-batch", type=int, default=64, help="thinker/talker --max-batch-size and --num-slots")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--buckets", default="1,2,4,8,16,32,64")
    p.add_argument("--code2wav-decoder", choices=list(Decoder), default=Decoder.INCREMENTAL.value,
                   help="code2wav's --decoder (default: the service's, incremental, its calls replayed from graphs "
                        "per block shape and batch bucket in the graphs-on mode; window: its chunk windows captured)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per stage (0: cores / 3)")
    p.add_argument("--sample-interval-s", type=float, default=0.5, help="stage gauges and GPU samples (default 0.5)")
    p.add_argument("--startup-timeout-s", type=float, default=180.0)
    p.add_argument("--deadline-s", type=float, default=420.0, help="everything, every mode, ends by then")
    p.add_argument("--pids-file", help="write the running stage processes' ids here (for the caller's clean-up)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.requests_per_client < 3:
        parser.error(f"--requests-per-client must be at least 3 (c in flight needs 3c requests), got "
                     f"{args.requests_per_client}")
    args.graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
    args.gpu_sharing = [GpuSharing(s.strip()) for s in args.gpu_sharing.split(",") if s.strip()]
    args.levels = sorted({int(x) for x in args.levels.split(",") if x.strip()})
    args.rates = [float(x) for x in args.rates.split(",") if x.strip()]
    if any(rate <= 0 for rate in args.rates):
        parser.error(f"--rates must be above 0 requests/s, got {args.rates}")
    if args.long_answer:
        args.thinker_tokens, args.talker_tokens = LONG_ANSWER[:2]
        args.max_model_len = max(args.max_model_len, LONG_ANSWER[2])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (the caller's timeout) unwinds like Ctrl-C, so the running stack (and its MPS daemon) is stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    report = DeviceBench(args).run()
    print((Path(args.out) / "device_bench.md").read_text())
    ran = [r for r in report.levels if not r.skipped]
    return 0 if ran and all(r.errors < r.requests for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
