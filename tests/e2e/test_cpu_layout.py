"""On a running stack (the launcher's default layout, CPU): at light load every thread of every
process runs where `cpu_layout` put it, the talker on a CPU of its own; with more than 4 streams
open a process may run anywhere, and goes back once the load falls (services/serving/placement.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from services.serving.open_streams import LIGHT_LOAD_STREAMS
from services.tools.client import build_request, collect, connect
from services.tools.launcher import cpu_layout


def allowed(pid: int) -> set[frozenset[int]]:
    """The distinct CPU sets the threads of `pid` may run on."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def layout(stack):
    threads = stack.options.threads  # 1, or OMNI_TEST_THREADS (tests/stacks.py)
    expected = cpu_layout(sorted(os.sched_getaffinity(0)), threads=threads, talkers=1)
    if expected is None:
        assert stack.layout is None
        pytest.skip(f"{len(os.sched_getaffinity(0))} CPUs for processes of {threads} threads: no layout")
    assert stack.layout == expected
    return expected


def test_at_light_load_every_thread_runs_where_the_layout_put_it(stack, layout):
    (talker_cpus,), rest = layout
    for process in stack.processes.values():
        want = talker_cpus if process.stage == "talker" else rest
        assert process.cpus == want
        assert len(os.listdir(f"/proc/{process.popen.pid}/task")) > 1, f"{process.name}: gRPC's threads should be up"
        wait_for(lambda pid=process.popen.pid, want=want: allowed(pid) == {want}, f"{process.name} on CPUs {sorted(want)}",
                 5.0)
    assert frozenset(os.sched_getaffinity(0)) == talker_cpus | rest  # the caller itself is not placed


@pytest.mark.slow  # 8 s of load to cross the light-load bound: make test-slow (CI)
def test_above_light_load_the_talker_may_run_anywhere_and_comes_back(stack, layout):
    (talker_cpus,), rest = layout
    talker = stack.processes["talker-0"].popen.pid
    channel, stub = connect(stack.target)
    results = []
    with channel:
        requests = [threading.Thread(target=lambda i=i: results.append(collect(stub, build_request(
            f"a long answer {i}", max_new_tokens=64, talker_max_new_tokens=400), timeout=120)))
            for i in range(LIGHT_LOAD_STREAMS + 3)]
        for request in requests:
            request.start()
        wait_for(lambda: allowed(talker) == {talker_cpus | rest}, "the talker on every CPU under load")
        for request in requests:
            request.join()
    assert len(results) == LIGHT_LOAD_STREAMS + 3 and all(r.final is not None for r in results)
    wait_for(lambda: allowed(talker) == {talker_cpus}, "the talker back on its own CPU", 5.0)
