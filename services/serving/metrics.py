"""Prometheus metrics of a stage: queue depth, running batch, step time, KV cache use, streams,
and where the time goes.

Each service serves them over HTTP on `--metrics-port` (0 = off) at /metrics.

Time accounting (what `omni-bench` prints per stage): the engine thread's wall time by phase,
`omni_stage_loop_seconds_total{phase}`: `forward` (model forwards, their module dispatch
included), `engine` (the rest of a step: scheduling, sampling, bookkeeping), `commands`
(handlers' adds and inputs applied on the engine thread, e.g. the talker's text projection),
`idle` (waiting for work); CPU seconds of the engine thread and of the whole process (the
difference is the gRPC handlers, the event loop and gRPC's own threads), and the seconds spent
encoding and decoding tensors, audio and frames for the wire (`omni_stage_wire_seconds`), and
the seconds its threads waited for a CPU (`omni_stage_process_cpu_wait_seconds`).
"""

from __future__ import annotations

import functools
import glob
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.serving.gc_heap import GCCollector


class _WireTime:
    """Seconds this process spent in services/serving/wire.py's encoders and decoders."""

    seconds = 0.0


WIRE_TIME = _WireTime()


def timed_wire(fn):
    """Count a wire encoder's or decoder's time in WIRE_TIME (omni_stage_wire_seconds)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            WIRE_TIME.seconds += time.perf_counter() - start

    return wrapper


def run_queue_wait_seconds() -> float:
    """Seconds this process's live threads spent ready to run but waiting for a CPU, from
    /proc/self/task/*/schedstat (its second field, ns). As long as threads run, this grows as
    fast as the wall clock times the threads waiting: the CPU is oversubscribed."""
    total = 0
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that just ended; no schedstat here
            continue
    return total / 1e9


PAUSE_BUCKETS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class StageMetrics:
    def __init__(self, stage: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self._exact: tuple | None = None  # exact mode's gauges, made at the first report (exact_kernels)
        self.registry.register(GCCollector())
        self.stage = stage
        ProcessCollector(registry=self.registry)  # process_start_time_seconds: the crash-loop alert (k8s/monitoring)
        labels = {"stage": stage}
        r = self.registry
        self.queue_depth = Gauge("omni_stage_queue_depth", "Requests admitted, waiting for a slot or input",
                                 ["stage"], registry=r).labels(**labels)
        self.running = Gauge("omni_stage_running_batch", "Requests holding a KV slot / decoder", ["stage"],
                             registry=r).labels(**labels)
        self.batch_size = Histogram("omni_stage_batch_size", "Requests per engine step", ["stage"], registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128)).labels(**labels)
        self.prefills = Histogram("omni_stage_prefills_per_step", "Prompts (or prompt chunks) prefilled per "
                                  "engine step that prefilled any", ["stage"], registry=r,
                                  buckets=(1, 2, 4, 8, 16, 32, 64)).labels(**labels)
        self.step_seconds = Histogram("omni_stage_step_seconds", "Engine step time", ["stage"], registry=r,
                                      buckets=STEP_BUCKETS).labels(**labels)
        self.cache_used = Gauge("omni_stage_cache_slots_used", "KV cache slots in use", ["stage"],
                                registry=r).labels(**labels)
        self.cache_capacity = Gauge("omni_stage_cache_slots", "KV cache slots", ["stage"],
                                    registry=r).labels(**labels)
        self.in_flight = Gauge("omni_stage_in_flight", "Streams open on this stage", ["stage"],
                               registry=r).labels(**labels)
        # Where the time goes (see the module docstring).
        self.loop_seconds = Counter("omni_stage_loop_seconds", "Engine thread wall time by phase",
                                    ["stage", "phase"], registry=r)
        self.phase = {phase: self.loop_seconds.labels(stage=stage, phase=phase)
                      for phase in ("forward", "engine", "commands", "idle")}
        self.forward_seconds = Histogram("omni_stage_forward_seconds", "Model forward time per engine step",
                                         ["stage"], registry=r, buckets=STEP_BUCKETS).labels(**labels)
        self.engine_cpu = Counter("omni_stage_engine_thread_cpu_seconds", "CPU time of the engine thread",
                                  ["stage"], registry=r).labels(**labels)
        Gauge("omni_stage_process_cpu_seconds", "CPU time of the whole stage process (every thread)", ["stage"],
              registry=r).labels(**labels).set_function(time.process_time)
        Gauge("omni_stage_process_cpu_wait_seconds",
              "Seconds the process's threads were runnable but waited for a CPU (Linux schedstat; 0 elsewhere)",
              ["stage"], registry=r).labels(**labels).set_function(run_queue_wait_seconds)
        Gauge("omni_stage_wire_seconds", "Seconds encoding and decoding tensors, audio and frames for the wire",
              ["stage"], registry=r).labels(**labels).set_function(lambda: WIRE_TIME.seconds)
        # Moves of a request to another replica of the next stage (services/serving/migration.py):
        # outcome moved (replayed there), failed (no fallback or moves left), diverged (the replay
        # parted from what was delivered).
        self.migrations = Counter("omni_stage_migrations", "Requests moved off a dead replica of the next stage",
                                  ["stage", "peer", "outcome"], registry=r)
        self.migration_pause = Histogram("omni_stage_migration_pause_seconds",
                                         "From a replica's failure to the first new output after the move",
                                         ["stage", "peer"], registry=r, buckets=PAUSE_BUCKETS)

    def exact_kernels(self, report) -> None:
        """What exact mode runs here (services/runtime/lm/invariance.py, services/code2wav/plan.py), again
        whenever a start-up check's verdict replaces it: one series per op with value 1, e.g.
        omni_exact_kernel_info{op="attention", path="rows"}, a gauge per chosen number, e.g.
        omni_exact_setting{name="block_frames"}, and where the plan came from, omni_exact_check
        (running: the check runs beside serving, the plan is exact by construction; checked, cached:
        its verdict, from this process or kept on disk; failed: it raised, the plan stays)."""
        if self._exact is None:
            r = self.registry
            self._exact = (
                Gauge("omni_exact_kernel_info", "Exact batching's kernel path per op, as exact mode's plan has it "
                      "(rows: one call per request; batched: checked invariant here; gemm: omni's invariant GEMM; "
                      "alone: no batching)", ["stage", "op", "path"], registry=r),
                Gauge("omni_exact_setting", "A number in exact mode's plan (code2wav: block_frames, max_batch, "
                      "open_blocks)", ["stage", "name"], registry=r),
                Enum("omni_exact_check", "Where exact mode's plan came from: its start-up check running beside "
                     "serving, checked, cached (a verdict kept on disk), failed, or none to run", ["stage"],
                     states=["none", "running", "checked", "cached", "failed"], registry=r))
        info, setting, check = self._exact
        info.clear()
        for op, path in report.paths().items():
            info.labels(stage=self.stage, op=op, path=path).set(1)
        setting.clear()
        for name, number in report.settings().items():
            setting.labels(stage=self.stage, name=name).set(number)
        check.labels(stage=self.stage).state(str(report.check))

    def prefix_cache(self, cache) -> None:
        """The thinker's prefix cache (services/runtime/lm/prefix/), read at each scrape."""
        self.registry.register(_PrefixCacheCollector(self.stage, cache))

    def encoder_cache(self, cache) -> None:
        """The thinker's media encoder cache (services/thinker/encoder_cache.py), read at each scrape."""
        self.registry.register(_EncoderCacheCollector(self.stage, cache))

    def serve(self, port: int, host: str = "0.0.0.0") -> int | None:
        if not port:
            return None
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port


class _PrefixCacheCollector(Collector):
    """omni_prefix_cache_*: what lookups asked for and found, what the pool holds and evicted."""

    def __init__(self, stage: str, cache):
        self.stage, self.cache = stage, cache

    def collect(self):
        stats, labels = self.cache.stats, [self.stage]
        for name, help_text, value in (
                ("lookup_tokens", "Prompt tokens in whole blocks a lookup asked the cache for", stats.lookup_tokens),
                ("hit_tokens", "Of those, tokens found and used (not prefilled again)", stats.hit_tokens),
                ("refused_tokens", "Tokens found but not used: exact mode's start-up check refused hits",
                 stats.refused_tokens),
                ("evictions", "Blocks evicted to make room (least recently used, never a pinned one)",
                 stats.evictions)):
            family = CounterMetricFamily(f"omni_prefix_cache_{name}", help_text, labels=["stage"])
            family.add_metric(labels, value)
            yield family
        for name, help_text, value in (("blocks", "Blocks held", self.cache.blocks),
                                       ("capacity_blocks", "Blocks the pool has room for", self.cache.capacity)):
            family = GaugeMetricFamily(f"omni_prefix_cache_{name}", help_text, labels=["stage"])
            family.add_metric(labels, value)
            yield family


class _EncoderCacheCollector(Collector):
    """omni_encoder_cache_*: media items found and encoded per modality, evictions, bytes held."""

    def __init__(self, stage: str, cache):
        self.stage, self.cache = stage, cache

    def collect(self):
        stats = self.cache.stats
        for name, help_text, counts in (
                ("hits", "Media items whose encoder output was found (not encoded again)", stats.hits),
                ("misses", "Media items encoded (not found)", stats.misses)):
            family = CounterMetricFamily(f"omni_encoder_cache_{name}", help_text, labels=["stage", "modality"])
            for modality, value in counts.items():
                family.add_metric([self.stage, modality], value)
            yield family
        family = CounterMetricFamily("omni_encoder_cache_evictions", "Entries evicted to make room (least recently "
                                     "used)", labels=["stage"])
        family.add_metric([self.stage], stats.evictions)
        yield family
        for name, help_text, value in (("bytes", "Bytes of encoder outputs held", self.cache.bytes),
                                       ("capacity_bytes", "Bytes the cache may hold (--encoder-cache-mb)",
                                        self.cache.capacity_bytes)):
            family = GaugeMetricFamily(f"omni_encoder_cache_{name}", help_text, labels=["stage"])
            family.add_metric([self.stage], value)
            yield family
