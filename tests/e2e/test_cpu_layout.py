"""On a running stack (the launcher's default layout, CPU): every thread of every process runs
where `cpu_layout` put it, the talker on a CPU of its own."""

from __future__ import annotations

import os

import pytest

from services.tools.launcher import cpu_layout


def allowed(pid: int) -> dict[int, frozenset[int]]:
    """Thread id -> the CPUs it may run on."""
    return {int(tid): frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def test_every_thread_of_the_running_stack_is_where_the_layout_put_it(stack):
    expected = cpu_layout(sorted(os.sched_getaffinity(0)), threads=1, talkers=1)
    if expected is None:
        assert stack.layout is None
        pytest.skip("one CPU: no layout to check")
    (talker_cpus,), rest = expected
    assert stack.layout == expected
    for process in stack.processes.values():
        want = talker_cpus if process.stage == "talker" else rest
        threads = allowed(process.popen.pid)
        assert len(threads) > 1, f"{process.name}: only its main thread (gRPC's threads should be up)"
        assert set(threads.values()) == {want}, f"{process.name}: {threads}"
    assert frozenset(os.sched_getaffinity(0)) == talker_cpus | rest  # the caller itself is not pinned
