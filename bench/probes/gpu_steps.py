"""Figure: docs/gpu.md, "gpu_steps.json" (each stage's engine step at full size, in process). Rerun on a GPU:
`python -m bench.probes.gpu_steps --checkpoint /tmp/omni-full-size --out out/device_check`
(bench/device_check.sh runs it first); CPU dry run: `DEVICE=cpu SMALL=1 bash bench/device_check.sh`.

One stage at a time, in this process, built as its service builds it (random weights on the
device, bfloat16, CUDA graphs on, exact batching off as on cuda), then freed before the next:
- after an untimed warm-up (one request prefilled and decoded a few steps):
- prefill: 1, 16 and 64 prompts of 25 tokens (25, 400 and 1,600 tokens) added at once, the wall
  time of the engine steps until every one has prefilled, and how many steps that took (admission
  as the service's defaults have it: --max-prefills-per-step and --max-prefill-tokens unset);
- decode at batch 1, 16 and 64 (the prefilled requests): per step the wall time, the engine's
  forward time (its ForwardTimer: on cuda the device time between events recorded as each forward
  starts and ends), the GPU time of every CUDA graph replay (CUDA events around each replay)
  and the host syncs torch's sync debug mode reports;
- a torch.profiler run of a few steps at batch 16: the top ops by device and by host time, saved as
  text (gpu_steps_<stage>_profile.txt), and host vs device milliseconds per step in the JSON.
The thinker's requests are 25 random text tokens; the talker's a 25-position prompt (the thinker
rows it reads are random) fed a text row per frame; code2wav's the talker's chunk schedule of
random codes. gpu_steps.json is written after every phase, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

PREFILL_TOKENS = 25  # tokens a prompt: 1, 16 and 64 of them are 25, 400 and 1,600 packed tokens
CODE2WAV_CHUNKS = (4, 8, 16)  # the talker's first chunks (services/runtime/chunking.py); then 25 a step
CODE2WAV_BLOCK = 25


@dataclass
class Prefill:
    prompts: int
    tokens: int  # positions prefilled, over every prompt
    steps: int
    wall_ms: float


@dataclass
class Decode:
    batch: int  # requests decoding
    steps: int
    rows_mean: float  # rows a step made (tokens, frames or audio chunks): below `batch` once some ended
    step_ms_p50: float
    step_ms_mean: float
    forward_ms_mean: float | None  # the engine's ForwardTimer, waiting for the GPU at its ends on cuda
    replays_per_step: float | None  # CUDA graph replays; None on CPU
    replay_gpu_ms_per_step: float | None  # CUDA events around each replay, summed over the step
    gpu_ms_per_replay: float | None  # the same per replay
    syncs_per_step: float | None  # host syncs torch.cuda.set_sync_debug_mode reports; None on CPU


@dataclass
class Profile:
    batch: int
    steps: int
    table: str  # the text file beside the JSON
    host_ms_per_step: float  # self CPU time of every op, summed
    device_ms_per_step: float | None  # self device time of every kernel, summed
    top: list[dict] = field(default_factory=list)  # the heaviest ops: name, calls, device and host ms in all


@dataclass
class StageSteps:
    stage: str
    build_s: float | None = None
    graphs: list[dict] = field(default_factory=list)  # per graph runner: name, captures, capture_s, failed
    prefill: list[Prefill] = field(default_factory=list)
    decode: list[Decode] = field(default_factory=list)
    profile: Profile | None = None
    error: str | None = None


@dataclass
class Report:
    config: dict
    environment: dict
    stages: list[StageSteps] = field(default_factory=list)
    wall_s: float = 0.0


# ---- the stages, as their services build them, and their synthetic requests ----

def build(stage: str, args):
    """(engine, loaded stage) for `stage` with random weights on args.device."""
    from services.runtime.model.checkpoint import Stage, load_stage
    from services.runtime.model.settings import GraphSettings

    loaded = load_stage(args.checkpoint, Stage(stage), device=args.device, dtype=args.dtype, random_weights=True)
    graphs = GraphSettings(args.device.startswith("cuda"), tuple(args.buckets))
    lm = dict(max_batch_size=max(args.batches), num_slots=max(args.batches), max_model_len=args.max_model_len,
              exact_batching=False, graphs=graphs)  # admission as the service's defaults have it
    if stage == "thinker":
        from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig

        return ThinkerEngine(loaded.model, loaded.config, args.device, ThinkerEngineConfig(**lm)), loaded
    if stage == "talker":
        from services.talker.engine import TalkerEngine
        from services.talker.engine_base import TalkerEngineConfig

        return TalkerEngine(loaded.model, loaded.config, args.device, TalkerEngineConfig(**lm)), loaded
    from services.code2wav.config import Code2WavConfig
    from services.code2wav.qwen3_adapter import Qwen3Code2WavAdapter
    from services.runtime.model.settings import ModelConfig
    from services.serving.config import ServingConfig

    # The service's default decoder (incremental) captures no graphs: on cuda code2wav runs eagerly, as it serves.
    config = Code2WavConfig(serving=ServingConfig(), model=ModelConfig(args.checkpoint, args.device, args.dtype,
                                                                       graphs=graphs),
                            exact=False, max_batch=max(args.batches), max_batch_frames=0)
    return Qwen3Code2WavAdapter(loaded, config).build_engine(), loaded


def add_requests(stage: str, engine, loaded, n: int, tag: str, budget: int) -> int:
    """`n` requests able to run `budget` decode steps; returns the positions their prefill covers."""
    import torch

    from services.runtime.lm.sampling import SamplingConfig

    gen = torch.Generator().manual_seed(n)
    config = loaded.config
    if stage == "thinker":
        from services.runtime.inputs.prompt import PromptInputs
        from services.thinker.engine import ThinkerJob

        vocab = int(config.thinker_config.text_config.vocab_size)
        for i in range(n):
            ids = torch.randint(10, min(vocab, 5000), (1, PREFILL_TOKENS), generator=gen)
            engine.add(f"{tag}{i}", ThinkerJob(PromptInputs(ids, torch.ones_like(ids)),
                                               SamplingConfig(max_new_tokens=budget), True))
        return n * PREFILL_TOKENS
    if stage == "talker":
        from services.runtime.model.qwen3_omni import talker_prompt_len
        from services.talker.engine import TalkerJob, TextRow

        hidden = int(config.thinker_config.text_config.hidden_size)
        speaker = int(next(iter(config.talker_config.speaker_id.values())))
        # User positions (2 + filler) and the assistant's 9: a 25-position talker prefill.
        ids = [config.im_start_token_id, config.user_token_id, *range(20, 20 + PREFILL_TOKENS - 11),
               config.im_start_token_id, config.assistant_token_id, 23]
        prompt_len = talker_prompt_len(ids, config)
        for i in range(n):
            engine.add(f"{tag}{i}", TalkerJob(
                prompt_token_ids=ids, prompt_embeds=torch.randn(len(ids), hidden, generator=gen),
                multimodal_positions=[], multimodal_hidden=torch.zeros(0, hidden),
                tts_embeds=torch.randn(3, hidden, generator=gen), speaker_id=speaker,
                sampling=SamplingConfig(max_new_tokens=budget, repetition_penalty=1.05), prompt_len=prompt_len))
            for _ in range(budget):
                engine.add_input(f"{tag}{i}", TextRow(torch.randn(hidden, generator=gen)))
        return n * prompt_len
    from services.code2wav.engine import CodecChunk

    for i in range(n):
        engine.add(f"{tag}{i}")
        for size in CODE2WAV_CHUNKS:
            engine.add_input(f"{tag}{i}", CodecChunk(torch.randint(0, engine.codebook_size, (size, engine.num_quantizers),
                                                                   generator=gen)))
    return 0


def feed_code2wav(engine) -> None:
    """A whole steady-state block (25 frames) for every request, before a step: each step decodes
    one block of every request, as code2wav does once the talker's chunks have grown."""
    import torch

    from services.code2wav.engine import CodecChunk

    for request_id in list(engine._requests):
        engine.add_input(request_id, CodecChunk(torch.randint(0, engine.codebook_size,
                                                              (CODE2WAV_BLOCK, engine.num_quantizers))))


def rows_of(events) -> tuple[int, int]:
    """(rows made, prefills ended) in a step's events."""
    names = [type(event).__name__ for _, event in events]
    return sum(name in ("Token", "Frame", "Audio") for name in names), names.count("Prefilled") + sum(
        name == "Frame" and event.index == 0 for name, (_, event) in zip(names, events))


# ---- measuring a step ----

class GraphReplays:
    """CUDA events around every replay of every captured graph the engine holds (cuda only)."""

    def __init__(self, engine):
        self.runners = find_runners(engine)
        self.pairs: list = []  # (start event, end event) of this step's replays

    def wrap(self) -> None:
        import torch

        for runner in self.runners:
            for captured in runner._graphs.values():
                graph = captured.graph
                if getattr(graph, "_timed", False):
                    continue
                replay = graph.replay

                def timed(replay=replay):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    replay()
                    end.record()
                    self.pairs.append((start, end))

                graph.replay, graph._timed = timed, True

    def take(self) -> tuple[int, float]:
        """(replays, GPU ms) since the last take; synchronises."""
        import torch

        torch.cuda.synchronize()
        pairs, self.pairs = self.pairs, []
        return len(pairs), sum(start.elapsed_time(end) for start, end in pairs)


def find_runners(engine) -> list:
    """Every GraphRunner reachable from the engine's attributes (its hooks, their runners, a
    vocoder's bound graph method), without walking into torch modules."""
    import torch

    from services.runtime.lm.cuda_graphs import GraphRunner

    found, seen, todo = [], set(), [(engine, 0)]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or isinstance(obj, torch.nn.Module | torch.Tensor) or depth > 4:
            continue
        seen.add(id(obj))
        if isinstance(obj, GraphRunner):
            found.append(obj)
            continue
        if hasattr(obj, "__self__"):
            todo.append((obj.__self__, depth + 1))
        for value in getattr(obj, "__dict__", {}).values():
            todo.append((value, depth + 1))
    return found


def timed_steps(engine, steps: int, cuda: bool, feed=None) -> tuple[list[float], list[float], list[int], list[int], list]:
    """Per step: wall ms, forward ms, rows, syncs and (replays, GPU ms). `feed(engine)` before each
    step gives it its inputs (code2wav's frames)."""
    import torch

    replays = GraphReplays(engine) if cuda else None
    walls, forwards, rows, syncs, gpu = [], [], [], [], []
    for _ in range(steps):
        if feed is not None:
            feed(engine)
        if not engine.has_work():
            break
        if replays is not None:
            replays.wrap()
        engine.timer.take()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            began = time.perf_counter()
            try:
                events = engine.step()
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
                    torch.cuda.synchronize()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
            walls.append((time.perf_counter() - began) * 1000)
        forwards.append(engine.timer.take() * 1000)
        rows.append(rows_of(events)[0])
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        if replays is not None:
            count, ms = replays.take()
            gpu.append((count, ms))
    return walls, forwards, rows, syncs, gpu


def prefill(stage: str, engine, loaded, n: int, budget: int) -> Prefill:
    import torch

    tokens = add_requests(stage, engine, loaded, n, f"p{n}-", budget)
    cuda = str(engine_device(engine)).startswith("cuda")
    if cuda:
        torch.cuda.synchronize()  # the work queued before is not this prefill's
    began, steps, done = time.perf_counter(), 0, 0
    while done < n and engine.has_work():
        events = engine.step()
        steps += 1
        done += rows_of(events)[1]
    if cuda:
        torch.cuda.synchronize()
    return Prefill(n, tokens, steps, round((time.perf_counter() - began) * 1000, 2))


def engine_device(engine):
    return getattr(engine, "device", None) or next(engine.vocoder.model.parameters()).device


def decode(engine, n: int, steps: int, warmup: int, cuda: bool, feed=None) -> Decode:
    timed_steps(engine, warmup, cuda)
    walls, forwards, rows, syncs, gpu = timed_steps(engine, steps, cuda, feed)
    if not walls:
        return Decode(n, 0, 0.0, 0.0, 0.0, None, None, None, None, None)
    replayed = sum(c for c, _ in gpu)
    return Decode(n, len(walls), round(statistics.fmean(rows), 2), round(statistics.median(walls), 3),
                  round(statistics.fmean(walls), 3), round(statistics.fmean(forwards), 3),
                  round(replayed / len(gpu), 2) if gpu else None,
                  round(statistics.fmean(ms for _, ms in gpu), 3) if gpu else None,
                  round(sum(ms for _, ms in gpu) / replayed, 3) if replayed else None,
                  round(statistics.fmean(syncs), 2) if cuda else None)


def profile(stage: str, engine, n: int, steps: int, cuda: bool, out: Path, feed=None) -> Profile | None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        ran = 0
        while ran < steps:
            if feed is not None:
                feed(engine)
            if not engine.has_work():
                break
            engine.step()
            ran += 1
    averages = prof.key_averages()
    if not ran or not averages:
        return None
    device_key = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    table = out / f"gpu_steps_{stage}_profile.txt"
    parts = [f"{stage}: {ran} engine steps at batch {n}, torch.profiler key averages (times in all {ran} steps)\n"]
    if cuda:
        parts += ["\nby self device time:\n", averages.table(sort_by=device_key, row_limit=30)]
    parts += ["\nby self host (CPU) time:\n", averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    table.write_text("".join(parts))
    device_us = sum(getattr(e, device_key, 0) for e in averages) if cuda else None
    heaviest = sorted(averages, key=lambda e: getattr(e, device_key, 0) if cuda else e.self_cpu_time_total,
                      reverse=True)[:12]
    return Profile(n, ran, table.name, round(sum(e.self_cpu_time_total for e in averages) / 1000 / ran, 3),
                   round(device_us / 1000 / ran, 3) if device_us is not None else None,
                   [{"name": e.key, "calls": e.count, "device_ms": round(getattr(e, device_key, 0) / 1000, 3) if cuda
                     else None, "host_ms": round(e.self_cpu_time_total / 1000, 3)} for e in heaviest])


def abort_all(engine) -> None:
    for request_id in list(engine._requests):
        engine.abort(request_id)


# ---- the run ----

class Run:
    def __init__(self, args):
        self.args = args
        self.started = time.monotonic()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.report = Report(config={k: v for k, v in vars(args).items()}, environment=environment())

    def write(self) -> None:
        self.report.wall_s = round(time.monotonic() - self.started, 1)
        (self.out / "gpu_steps.json").write_text(json.dumps(asdict(self.report), indent=1) + "\n")

    def say(self, message: str) -> None:
        print(f"[gpu_steps {time.monotonic() - self.started:6.1f} s] {message}", flush=True)

    def stage(self, stage: str) -> None:
        import torch

        a = self.args
        cuda = a.device.startswith("cuda")
        result = StageSteps(stage)
        self.report.stages.append(result)
        engine = loaded = None
        try:
            began = time.monotonic()
            engine, loaded = build(stage, a)
            if cuda:
                torch.cuda.synchronize()
            result.build_s = round(time.monotonic() - began, 1)
            result.graphs = [{"name": r.name, "captures": r.stats.captures, "capture_s": round(r.stats.capture_s, 2),
                              "failed": r.stats.failed} for r in find_runners(engine)]
            self.say(f"{stage}: built in {result.build_s} s; graphs {result.graphs}")
            self.write()
            budget = a.warmup + a.steps + a.profile_steps + 8
            # Warm-up, untimed: a first prefill and decode pay one-off costs (kernel selection, lazy
            # initialisation, the allocator's first blocks) that serving pays once at start-up.
            add_requests(stage, engine, loaded, 1, "warm-", budget)
            timed_steps(engine, a.warmup + 1, cuda, feed_code2wav if stage == "code2wav" else None)
            abort_all(engine)
            for n in a.batches:
                if stage == "code2wav":  # no prompt: its requests are their frames
                    add_requests(stage, engine, loaded, n, f"d{n}-", budget)
                else:
                    result.prefill.append(prefill(stage, engine, loaded, n, budget))
                    self.say(f"{stage}: prefill {result.prefill[-1]}")
                feed = feed_code2wav if stage == "code2wav" else None
                result.decode.append(decode(engine, n, a.steps, a.warmup, cuda, feed))
                self.say(f"{stage}: decode {result.decode[-1]}")
                if n == a.profile_batch:
                    result.profile = profile(stage, engine, n, a.profile_steps, cuda, self.out, feed)
                    if result.profile is not None:
                        self.say(f"{stage}: profile host {result.profile.host_ms_per_step} ms, device "
                                 f"{result.profile.device_ms_per_step} ms a step -> {result.profile.table}")
                abort_all(engine)
                self.write()
        except Exception as exc:  # noqa: BLE001 - record it, go on with the next stage
            result.error = f"{type(exc).__name__}: {exc}"
            self.say(f"{stage}: {result.error}\n{traceback.format_exc()}")
        finally:
            del engine, loaded
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            self.write()

    def run(self) -> Report:
        for stage in self.args.stages:
            self.stage(stage)
        self.write()
        return self.report


def environment() -> dict:
    import platform

    import torch

    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.gpu_steps", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a folder from omni-tiny-checkpoint [--full-size] --no-weights")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--stages", default="thinker,talker,code2wav")
    p.add_argument("--batches", default="1,16,64", help="prefill prompts and decode batch sizes (default 1,16,64)")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed at each batch (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before them (default 3)")
    p.add_argument("--profile-batch", type=int, default=16)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--buckets", default="1,2,4,8,16,32,64")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    args.batches = [int(x) for x in args.batches.split(",") if x.strip()]
    args.buckets = [int(x) for x in args.buckets.split(",") if x.strip()]
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    report = Run(args).run()
    return 0 if all(s.error is None for s in report.stages) else 1


if __name__ == "__main__":
    sys.exit(main())
