"""The forward timer: nested blocks count once; with a device sync the outermost block waits for the
device's queued work as it starts and as it ends, so a forward's kernels count in it; with a device
clock (cuda's timing events) it times the same span on the device and waits for nothing until `take`."""

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


def test_sync_runs_at_the_outermost_block_start_and_end_inside_the_timed_span():
    events = []  # (what, perf_counter)
    timer = ForwardTimer(sync=lambda: (events.append(("sync", time.perf_counter())), time.sleep(0.02)))
    before = time.perf_counter()
    with timer:
        with timer:
            events.append(("forward", time.perf_counter()))
    after = time.perf_counter()
    assert [what for what, _ in events] == ["sync", "forward", "sync"]
    # The work queued before the block is waited for outside it; the end's wait (the forward's own
    # kernels, here a 20 ms sleep) is inside it.
    assert 0.02 <= timer.seconds <= after - before - 0.02


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
