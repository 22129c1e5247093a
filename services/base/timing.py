"""Where an engine step's time goes: the part spent in model forwards, as the engine loop reports
it (`omni_stage_loop_seconds{phase="forward"}`; the rest of a step is scheduling, sampling and
bookkeeping in Python).

An engine holds one `ForwardTimer` and wraps each model call in `with self.timer:`; the loop
takes the accumulated seconds after every step. Nested blocks count once. A forward includes the
Python dispatch of the modules it runs (transformers' wrappers, per-row loops): what it excludes
is everything around it.
"""

from __future__ import annotations

import time


class ForwardTimer:
    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        self._start = 0.0

    def __enter__(self):
        if self._depth == 0:
            self._start = time.perf_counter()
        self._depth += 1
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._start
            self.calls += 1
        return False

    def take(self) -> float:
        """Seconds accumulated since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
