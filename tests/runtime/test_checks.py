"""Exact mode's start-up checks beside serving and their verdicts on disk
(services/runtime/checks.py): a verdict is reused only for its own key, a bad file is
checked again, a check that raises keeps nothing, and a check beside serving hands its verdict over
once, from a thread at the lowest priority."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest

from services.runtime.checks import CheckState, StartupCheck, VerdictCache, machine
from services.runtime.model.settings import CheckSettings


class Counted:
    """A check's run: counts its calls, returns `verdict` (or raises `error`) once `gate` opens."""

    def __init__(self, verdict: dict | None = None, error: Exception | None = None, gate: threading.Event | None = None):
        self.verdict, self.error, self.gate = verdict or {"batches": [1, 2]}, error, gate
        self.calls = 0
        self.priority: int | None = None

    def __call__(self) -> dict:
        self.calls += 1
        self.priority = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.error is not None:
            raise self.error
        return dict(self.verdict)


def check(run, folder, shapes=None, background=False) -> StartupCheck:
    return StartupCheck("test blocks", shapes or {"grid": [4, 8]}, run, dict, dict,
                        CheckSettings(background=background, cache=str(folder) if folder else ""))


def test_a_verdict_is_kept_and_reused_on_the_same_machine_for_the_same_shapes(tmp_path):
    run = Counted()
    first = check(run, tmp_path)
    assert first.start() == {"batches": [1, 2]} and first.state is CheckState.CHECKED
    again = check(run, tmp_path)
    assert again.start() == {"batches": [1, 2]} and again.state is CheckState.CACHED
    assert run.calls == 1
    other = check(run, tmp_path, shapes={"grid": [4, 8, 16]})  # other shapes: another key, checked
    assert other.start() is not None and other.state is CheckState.CHECKED and run.calls == 2
    assert len(list(tmp_path.glob("test-blocks-*.json"))) == 2


def test_the_key_holds_the_cpu_torch_threads_and_capability():
    key = machine()
    assert {"cpu", "cpu_flags", "torch", "torch_build", "capability", "threads"} <= set(key)
    import torch

    assert key["threads"] == torch.get_num_threads() and key["torch"] == torch.__version__


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 1, "key": {"check": "other"},
                                                                "verdict": {"batches": [1, 2, 3]}}),
                                     json.dumps({"format": 99}), json.dumps([1, 2])])
def test_a_corrupt_or_foreign_verdict_file_is_ignored_and_checked_again(tmp_path, content, caplog):
    run = Counted()
    path = VerdictCache(str(tmp_path)).path(check(run, tmp_path).key)
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="services.runtime.checks"):
        again = check(run, tmp_path)
        assert again.start() == {"batches": [1, 2]} and again.state is CheckState.CHECKED and run.calls == 1
    assert "checking again" in caplog.text
    assert check(run, tmp_path).start() is not None and run.calls == 1  # the file now holds this key's verdict


def test_a_malformed_verdict_for_this_key_is_checked_again(tmp_path):
    def strict(data: dict) -> dict:
        if data.get("batches") != [1, 2]:
            raise ValueError("no batches")
        return data

    run = Counted()
    first = check(run, tmp_path)
    first.start()
    path = VerdictCache(str(tmp_path)).path(first.key)
    data = json.loads(path.read_text())
    data["verdict"] = {"batches": "many"}
    path.write_text(json.dumps(data))
    again = StartupCheck("test blocks", {"grid": [4, 8]}, run, dict, strict, CheckSettings(cache=str(tmp_path)))
    assert again.start() == {"batches": [1, 2]} and again.state is CheckState.CHECKED and run.calls == 2


def test_a_check_that_raises_keeps_nothing_and_says_so_once(tmp_path, caplog):
    run = Counted(error=RuntimeError("kernel exploded"))
    with caplog.at_level(logging.ERROR, logger="services.runtime.checks"):
        failed = check(run, tmp_path)
        assert failed.start() is None and failed.state is CheckState.FAILED
    assert [r.getMessage() for r in caplog.records].count(
        "test blocks: the check failed; the plan invariant by construction stays") == 1
    assert not list(tmp_path.iterdir())  # nothing kept: the next start checks again


def test_beside_serving_the_verdict_is_handed_over_once_from_a_thread_at_the_lowest_priority(tmp_path):
    gate = threading.Event()
    run = Counted(gate=gate)
    beside = check(run, tmp_path, background=True)
    assert beside.start() is None and beside.state is CheckState.RUNNING
    assert not beside.ended()
    gate.set()
    assert beside.wait(30)
    assert beside.ended() and beside.verdict == {"batches": [1, 2]} and beside.state is CheckState.CHECKED
    assert not beside.ended()  # once
    assert run.priority == 19
    assert check(run, tmp_path, background=True).start() is not None and run.calls == 1  # kept


def test_a_folder_that_cannot_be_written_costs_only_the_reuse(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    run = Counted()
    with caplog.at_level(logging.WARNING, logger="services.runtime.checks"):
        assert check(run, blocked).start() == {"batches": [1, 2]}
    assert "could not keep the verdict" in caplog.text
    assert check(run, None).start() is not None and run.calls == 2  # no folder: every start checks


def test_a_check_still_running_when_its_engine_closes_stops_between_kernels_and_keeps_nothing(tmp_path):
    """A stage drained by SIGTERM while its check runs: the check's thread leaves torch before the
    process exits (it aborted there: "terminate called without an active exception")."""
    started = threading.Event()

    def endless():  # torch kernels in a loop that a guard catching Exception would not end
        import torch
        x = torch.randn(256, 256)
        started.set()
        while True:
            try:
                x = torch.tanh(x @ x)
            except Exception:  # noqa: BLE001 - like the checks' guards
                pass

    beside = check(endless, tmp_path, background=True)
    assert beside.start() is None and started.wait(30)
    assert beside.stop(timeout=30)
    assert beside.wait(0) and beside.verdict is None and beside.state is CheckState.RUNNING
    assert not list(tmp_path.iterdir())  # nothing kept: the next start checks again
    assert check(Counted(), tmp_path).stop()  # a check that never ran a thread has nothing to stop
