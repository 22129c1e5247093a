"""Where an engine step's time goes: the part spent in model forwards, as the engine loop reports
it (`omni_stage_loop_seconds{phase="forward"}`; the rest of a step is scheduling, sampling and
bookkeeping in Python).

An engine holds one `ForwardTimer` and wraps each model call in `with self.timer:`; the loop
takes the accumulated seconds after every step. Nested blocks count once. A forward includes the
Python dispatch of the modules it runs (transformers' wrappers, per-row loops): what it excludes
is everything around it.

On a GPU the kernels a forward launches run after the Python that launched them returns, so a
timer that only reads the host clock counts launches as the forward and the kernels' run as
whatever comes next (the sampling that first reads their result). The engines on cuda pass `clock`
(a factory of timing events, `torch.cuda.Event(enable_timing=True)`; the base never imports torch):
the outermost block records an event on the device's stream as it starts and one as it ends, and
`take` adds the device time between them, read once the step's own copy to the host has waited
for the stream, so timing adds no wait to a step (it counts the gaps between the forward's
kernels too: what the forward held the device for).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class ForwardTimer:
    def __init__(self, clock: Callable[[], Any] | None = None):
        self.seconds = 0.0
        self.calls = 0
        self.clock = clock  # makes a device event (record, synchronize, elapsed_time in ms); None: the host clock
        self._depth = 0
        self._start = 0.0
        self._start_event = None
        self._spans: list[tuple[Any, Any]] = []  # (start, end) device events not yet read

    def __enter__(self):
        if self._depth == 0:
            self._start = time.perf_counter()
            if self.clock is not None:
                self._start_event = self.clock()
                self._start_event.record()
        self._depth += 1
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            if self.clock is not None:
                end = self.clock()
                end.record()
                self._spans.append((self._start_event, end))
            else:
                self.seconds += time.perf_counter() - self._start
            self.calls += 1
        return False

    def take(self) -> float:
        """Seconds accumulated since the last take (device spans read here: each end event waited
        for, already passed where the step copied its results to the host)."""
        spans, self._spans = self._spans, []
        for start, end in spans:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000
        seconds, self.seconds = self.seconds, 0.0
        return seconds
