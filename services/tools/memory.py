"""Resident memory of processes over a run, from /proc, and its growth: the mean of the first
window against the mean of the last (`omni-soak` reports it per process)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


def rss_bytes(pid: int) -> int | None:
    """VmRSS of `pid` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass
class MemoryWatch:
    """Samples every process's RSS every `interval_s` on a thread of its own."""

    pids: dict  # name -> pid, or name -> callable returning the current pid (a restarted process)
    interval_s: float = 5.0
    samples: dict = field(default_factory=dict)  # name -> [(monotonic time, rss bytes)]
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        now = time.monotonic()
        for name, pid in self.pids.items():
            rss = rss_bytes(pid() if callable(pid) else pid)
            if rss is not None:
                self.samples.setdefault(name, []).append((now, rss))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> MemoryWatch:
        self._thread = threading.Thread(target=self._run, name="soak-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sample()

    def report(self, window_s: float) -> dict:
        """name -> {first_mb, last_mb, growth_mb, peak_mb, window_s}: mean RSS of the first and the
        last `window_s` of samples (the whole run's first and last third when it is shorter)."""
        out = {}
        for name, samples in self.samples.items():
            if not samples:
                continue
            start, end = samples[0][0], samples[-1][0]
            window = min(window_s, max((end - start) / 3, 0.0))
            first = [rss for t, rss in samples if t <= start + window] or [samples[0][1]]
            last = [rss for t, rss in samples if t >= end - window] or [samples[-1][1]]
            mb = 1 << 20
            out[name] = {
                "first_mb": round(sum(first) / len(first) / mb, 1), "last_mb": round(sum(last) / len(last) / mb, 1),
                "growth_mb": round((sum(last) / len(last) - sum(first) / len(first)) / mb, 1),
                "peak_mb": round(max(rss for _, rss in samples) / mb, 1), "window_s": round(window, 1),
            }
        return out
