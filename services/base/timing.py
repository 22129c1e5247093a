"""Where an engine step's time goes: the part spent in model forwards, as the engine loop reports
it (`omni_stage_loop_seconds{phase="forward"}`; the rest of a step is scheduling, sampling and
bookkeeping in Python).

An engine holds one `ForwardTimer` and wraps each model call in `with self.timer:`; the loop
takes the accumulated seconds after every step. Nested blocks count once. A forward includes the
Python dispatch of the modules it runs (transformers' wrappers, per-row loops): what it excludes
is everything around it.

On a GPU the kernels a forward launches run after the Python that launched them returns, so a
timer that only reads the host clock counts launches as the forward and the kernels' run as
whatever comes next (the sampling that first reads their result). Its owner passes `sync`
(`torch.cuda.synchronize` where the engine's device is cuda; the base never imports torch, the
router imports it): the outermost block then waits for the device's queued work before it starts
(the work before it is not this forward's) and before it ends (the forward's own kernels are).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class ForwardTimer:
    def __init__(self, sync: Callable[[], None] | None = None):
        self.seconds = 0.0
        self.calls = 0
        self.sync = sync  # waits for the device's queued work; None on CPU, where a call returns when it is done
        self._depth = 0
        self._start = 0.0

    def __enter__(self):
        if self._depth == 0:
            if self.sync is not None:
                self.sync()
            self._start = time.perf_counter()
        self._depth += 1
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            if self.sync is not None:
                self.sync()
            self.seconds += time.perf_counter() - self._start
            self.calls += 1
        return False

    def take(self) -> float:
        """Seconds accumulated since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
