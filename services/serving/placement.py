"""Where this process's threads run: on the CPUs the launcher gave it while the process is lightly
loaded, on every CPU it may use otherwise (`--light-load-cpus`, set by `omni-serve up`'s CPU
layout: services/tools/launcher.py, `cpu_layout`).

NOTE: why only at light load. On 2 cores a talker with a CPU of its own, the other processes on
the other, cut TTFP p50 at concurrency 1 by a fifth and at 16 by a third, but at 16 it also cost
10-14 % of the requests a second and left the player 0.97 underruns per request (none unpinned):
code2wav, the busiest stage at 16, then shared one core with the thinker and the router. So the
layout holds while at most LIGHT_LOAD_STREAMS streams are open on the process (as the thinker's
audio first), and every thread may run anywhere above that. Each process decides from its own
open streams; they rise and fall together, since every request passes every stage.
"""

from __future__ import annotations

import logging
import os

from services.base.errors import UserError
from services.serving.open_streams import LIGHT_LOAD_STREAMS

log = logging.getLogger(__name__)

def parse_cpus(text: str) -> frozenset[int] | None:
    """'1' or '0,2,3' -> the CPU set; '' -> None (no placement)."""
    if not text.strip():
        return None
    try:
        cpus = frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--light-load-cpus: expected CPU numbers like 1 or 0,2, got {text!r}") from None
    if not cpus or min(cpus) < 0:
        raise UserError(f"--light-load-cpus: expected CPU numbers like 1 or 0,2, got {text!r}")
    return cpus


def place_threads(cpus: frozenset[int]) -> None:
    """Every thread of this process onto `cpus`; threads started later inherit their starter's."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that just ended


class Placement:
    """This process on `light` while at most LIGHT_LOAD_STREAMS streams are open, on every CPU it
    was started with otherwise. `update(open_streams)` is called on every open and close of a
    stream (OpenStreams), so the process moves the moment its load crosses the line: polling
    every 50 ms held a burst's first requests on the light-load CPUs for up to 50 ms, and engine
    steps then ran 2-10x their CPU time in wall time (waiting for a CPU)."""

    def __init__(self, light: frozenset[int]):
        self.anywhere = frozenset(os.sched_getaffinity(0))
        self.light = light & self.anywhere or self.anywhere  # CPUs it may not use are not asked for
        self.current: frozenset[int] | None = None
        log.info("CPUs %s at light load (at most %d open streams), %s above", cpu_list(self.light),
                 LIGHT_LOAD_STREAMS, cpu_list(self.anywhere))

    def update(self, open_streams: int) -> None:
        want = self.light if open_streams <= LIGHT_LOAD_STREAMS else self.anywhere
        if want != self.current:
            place_threads(want)
            self.current = want


def cpu_list(cpus: frozenset[int]) -> str:
    """The CPU set as `--light-load-cpus` takes it (parse_cpus' inverse): '0,2'."""
    return ",".join(map(str, sorted(cpus)))
