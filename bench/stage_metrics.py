"""Where each stage's time goes, from the stages' own Prometheus metrics (services/serving/metrics.py).

The bench starts its stack with `--metrics-base-port`, scrapes every stage before and after each
pipeline block and keeps the differences: per stage, the engine thread's wall time by phase
(model forwards, the rest of the engine step in Python, handler commands applied on the engine
thread, idle), its steps and batch sizes, and CPU time: the engine thread's, the whole process's
(the rest is the gRPC handlers, the event loop and gRPC's threads) and the part spent encoding
and decoding tensors, audio and frames for the wire.
"""

from __future__ import annotations

import urllib.request
from dataclasses import asdict, dataclass, fields

from services.base.stages import Stage

PHASES = ("forward", "engine", "commands", "idle")


def scrape(url: str, timeout_s: float = 5.0) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of every sample at `url`."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse(response.read().decode())


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of every sample in Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def histogram_quantile(before: dict, after: dict, name: str, q: float) -> float | None:
    """The upper bound of the bucket that holds quantile `q` of histogram `name`'s observations
    between two scrapes (`before` may be {}); None when it had none."""
    buckets = sorted((float(dict(labels)["le"]), value - before.get((sample, labels), 0.0))
                     for (sample, labels), value in after.items() if sample == f"{name}_bucket")
    if not buckets or not buckets[-1][1]:
        return None
    return next(le for le, count in buckets if count >= q * buckets[-1][1])


def _get(samples: dict, name: str, **labels) -> float:
    for (sample, sample_labels), value in samples.items():
        if sample == name and all(dict(sample_labels).get(k) == v for k, v in labels.items()):
            return value
    return 0.0


@dataclass
class StageTimes:
    """One stage's time over an interval (differences of two scrapes), summed over blocks."""

    steps: float = 0.0
    step_s: float = 0.0
    batch_sum: float = 0.0  # requests per step, summed over steps
    batch_steps: float = 0.0
    prefills: float = 0.0  # prompts (or chunks) prefilled, summed over the LM steps that prefilled any
    prefill_steps: float = 0.0
    forward_s: float = 0.0
    engine_s: float = 0.0
    commands_s: float = 0.0
    idle_s: float = 0.0
    engine_cpu_s: float = 0.0
    process_cpu_s: float = 0.0
    wire_s: float = 0.0
    cpu_wait_s: float = 0.0  # the process's threads ready to run, waiting for a CPU

    @classmethod
    def from_samples(cls, samples: dict, stage: str) -> StageTimes:
        return cls(
            steps=_get(samples, "omni_stage_step_seconds_count", stage=stage),
            step_s=_get(samples, "omni_stage_step_seconds_sum", stage=stage),
            batch_sum=_get(samples, "omni_stage_batch_size_sum", stage=stage),
            batch_steps=_get(samples, "omni_stage_batch_size_count", stage=stage),
            prefills=_get(samples, "omni_stage_prefills_per_step_sum", stage=stage),
            prefill_steps=_get(samples, "omni_stage_prefills_per_step_count", stage=stage),
            forward_s=_get(samples, "omni_stage_loop_seconds_total", stage=stage, phase="forward"),
            engine_s=_get(samples, "omni_stage_loop_seconds_total", stage=stage, phase="engine"),
            commands_s=_get(samples, "omni_stage_loop_seconds_total", stage=stage, phase="commands"),
            idle_s=_get(samples, "omni_stage_loop_seconds_total", stage=stage, phase="idle"),
            engine_cpu_s=_get(samples, "omni_stage_engine_thread_cpu_seconds_total", stage=stage),
            process_cpu_s=_get(samples, "omni_stage_process_cpu_seconds", stage=stage),
            wire_s=_get(samples, "omni_stage_wire_seconds", stage=stage),
            cpu_wait_s=_get(samples, "omni_stage_process_cpu_wait_seconds", stage=stage),
        )

    def minus(self, other: StageTimes) -> StageTimes:
        return StageTimes(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def plus(self, other: StageTimes) -> StageTimes:
        return StageTimes(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    # Derived, for the report.
    @property
    def busy_s(self) -> float:
        return self.forward_s + self.engine_s + self.commands_s

    @property
    def handlers_cpu_s(self) -> float:
        """CPU outside the engine thread less the wire encoding: gRPC, the event loop, handlers."""
        return max(self.process_cpu_s - self.engine_cpu_s - self.wire_s, 0.0)

    def shares(self) -> dict[str, float]:
        """Fractions of the busy engine-thread time plus the off-thread CPU (wire, gRPC/handlers):
        what one step's work costs the stage, summing to 1."""
        parts = {"model forward": self.forward_s, "engine python": self.engine_s,
                 "commands": self.commands_s, "wire (de)serialization": self.wire_s,
                 "grpc + handlers": self.handlers_cpu_s}
        total = sum(parts.values())
        return {k: (v / total if total > 0 else 0.0) for k, v in parts.items()}

    def to_json(self) -> dict:
        return {**asdict(self), "shares": self.shares(), "handlers_cpu_s": self.handlers_cpu_s}


class StageScraper:
    """The stack's stage processes' metrics endpoints: name -> (stage, url)."""

    def __init__(self, endpoints: dict[str, tuple[str, str]]):
        self.endpoints = endpoints

    @classmethod
    def for_stack(cls, stack) -> StageScraper:
        endpoints = {}
        for name, process in stack.processes.items():
            if process.stage not in tuple(Stage) or "--metrics-port" not in process.args:  # stages only
                continue
            port = process.args[process.args.index("--metrics-port") + 1]
            endpoints[name] = (process.stage, f"http://{stack.options.host}:{port}/metrics")
        return cls(endpoints)

    def exact_kernels(self) -> dict[str, dict[str, str]]:
        """process name -> op -> the kernel path its exact-batching probe chose (LM stages only)."""
        out = {}
        for name, (_, url) in self.endpoints.items():
            try:
                samples = scrape(url)
            except OSError:
                continue
            paths = {dict(labels)["op"]: dict(labels)["path"] for (sample, labels), v in samples.items()
                     if sample == "omni_exact_kernel_info" and v == 1}
            if paths:
                out[name] = paths
        return out

    def snapshot(self) -> dict[str, StageTimes]:
        out = {}
        for name, (stage, url) in self.endpoints.items():
            try:
                out[name] = StageTimes.from_samples(scrape(url), stage)
            except OSError:
                continue  # a stage that does not answer: left out of this interval
        return out


def interval(before: dict[str, StageTimes], after: dict[str, StageTimes]) -> dict[str, StageTimes]:
    return {name: after[name].minus(before[name]) for name in after if name in before}
