"""The forward timer: nested blocks count once; with a device clock (cuda's timing events) the
outermost block is timed on the device, and nothing is waited for until `take`."""

from __future__ import annotations

import time

from services.base.timing import ForwardTimer


def test_nested_blocks_count_once_and_take_resets():
    timer = ForwardTimer()
    with timer:
        with timer:
            time.sleep(0.01)
    assert timer.calls == 1 and timer.seconds >= 0.01
    assert timer.take() >= 0.01 and timer.seconds == 0.0


class _Event:
    """A device event's interface (torch.cuda.Event): record, synchronize, elapsed_time in ms."""

    waited = 0

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        _Event.waited += 1

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1000


def test_a_device_clock_times_the_outermost_block_between_events_read_only_at_take():
    _Event.waited = 0
    timer = ForwardTimer(clock=_Event)
    with timer:
        with timer:
            time.sleep(0.01)
    assert timer.calls == 1
    assert timer.seconds == 0.0 and _Event.waited == 0  # nothing waited for inside the step
    assert 0.01 <= timer.take() < 1.0
    assert _Event.waited == 1 and timer.take() == 0.0
