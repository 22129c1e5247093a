"""Short garbage-collector pauses in a serving process: the heap built at start-up is frozen out of
the collector's reach, and the pauses that remain are measured.

NOTE: why. A stage process tracks about 360,000 objects once its model is loaded (transformers',
torch's and gRPC's modules and classes, mostly), and a full collection traverses every one:
*measured* 215-250 ms per full collection in a tiny-checkpoint thinker or code2wav process (2-core
Xeon). The collection holds the GIL, so every stream of the process stalls for that long, an
audible gap. They are rare while serving (the collector runs one when the objects that survived
younger collections reach a quarter of the old ones), and at start-up they come every second or
so. `gc.freeze()` after start-up moves those objects to a permanent generation that collections
skip: a full collection then took under 0.1 ms. Objects made later, per request, are collected
as before. A cycle among frozen objects is never freed; `freeze_startup_heap` collects first, so
only what is live at start-up is frozen.

`omni_gc_pause_seconds{generation}` (a histogram on every stage's, the router's and the
gateway's /metrics) shows what is left: the wall time of each collection, from `gc.callbacks`.
"""

from __future__ import annotations

import bisect
import gc
import threading
import time

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

GC_PAUSE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def freeze_startup_heap() -> int:
    """Collect, then move every object still tracked to the permanent generation; the count."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class _Pauses:
    """Per generation: counts per bucket and the sum, updated from one gc callback per process."""

    def __init__(self):
        # Reentrant: a collection can start inside `snapshot`, in the same thread (it allocates).
        self.lock = threading.RLock()
        self.buckets = [[0] * (len(GC_PAUSE_BUCKETS) + 1) for _ in range(3)]
        self.sums = [0.0] * 3
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        # A collection runs in the thread that triggered it, holding the GIL: start and stop pair.
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        generation = info["generation"]
        with self.lock:
            self.buckets[generation][bisect.bisect_left(GC_PAUSE_BUCKETS, seconds)] += 1
            self.sums[generation] += seconds

    def snapshot(self) -> tuple[list[list[int]], list[float]]:
        with self.lock:
            return [list(counts) for counts in self.buckets], list(self.sums)


_PAUSES: _Pauses | None = None
_PAUSES_LOCK = threading.Lock()


class GCCollector(Collector):
    """omni_gc_pause_seconds{generation} and omni_gc_frozen_objects, for one registry."""

    def __init__(self):
        global _PAUSES
        with _PAUSES_LOCK:
            if _PAUSES is None:
                _PAUSES = _Pauses()
        self._pauses = _PAUSES

    def collect(self):
        pauses = HistogramMetricFamily("omni_gc_pause_seconds", "Wall time of each garbage collection",
                                       labels=["generation"])
        buckets, sums = self._pauses.snapshot()
        for generation in range(3):
            cumulative, total = [], 0
            for bound, count in zip((*map(str, GC_PAUSE_BUCKETS), "+Inf"), buckets[generation]):
                total += count
                cumulative.append((bound, total))
            pauses.add_metric([str(generation)], cumulative, sums[generation])
        yield pauses
        yield GaugeMetricFamily("omni_gc_frozen_objects", "Objects frozen out of garbage collection at start-up",
                                value=gc.get_freeze_count())
