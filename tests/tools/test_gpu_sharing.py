"""--gpu-sharing mps without a GPU: where MPS cannot start it is one log line and no daemon (the
stack runs without it); a daemon the launcher starts (here a stand-in nvidia-cuda-mps-control that
makes the control pipe and records what it is sent) is checked, handed to the stage processes'
environments with each stage's percentage, and quit on stop; a joined one is used and left running.
The stack itself starting with MPS asked for and missing: tests/tools/test_launcher.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from services.base.errors import UserError
from services.base.stages import Stage
from services.tools import launcher
from services.tools.gpu_sharing import (
    LOG_ENV,
    PERCENT_ENV,
    PIPE_ENV,
    GpuSharing,
    MpsDaemon,
    MpsPercent,
    start_mps,
)
from services.tools.launcher import Stack, StackOptions


def fake_control(tmp_path: Path, fail_start: bool = False) -> tuple[str, Path]:
    """A stand-in nvidia-cuda-mps-control: `-d` makes the control pipe (or fails); any other call
    appends its stdin (the commands) to the record."""
    record = tmp_path / "record.txt"
    script = tmp_path / "bin" / "nvidia-cuda-mps-control"
    script.parent.mkdir()
    script.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -d ]; then
  echo "daemon $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> {record}
  {'echo "An instance of this daemon is already running" >&2; exit 1' if fail_start else ''}
  mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
echo "command $(cat) to $CUDA_MPS_PIPE_DIRECTORY" >> {record}
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), record


def test_mps_on_a_cpu_device_is_one_line_and_no_daemon():
    lines = []
    assert start_mps("cpu", lines.append) is None
    assert len(lines) == 1 and "not cuda" in lines[0] and "running without MPS" in lines[0]


def test_mps_control_missing_is_one_line_and_no_daemon(tmp_path):
    lines = []
    assert start_mps("cuda", lines.append, environ={"PATH": str(tmp_path)}) is None
    assert len(lines) == 1 and "nvidia-cuda-mps-control is not on PATH" in lines[0], lines


def test_a_daemon_that_fails_to_start_is_one_line_and_no_daemon(tmp_path):
    control, record = fake_control(tmp_path, fail_start=True)
    lines = []
    assert start_mps("cuda", lines.append, control=control, environ={"PATH": os.environ["PATH"]}) is None
    assert len(lines) == 1 and "exited with code 1: An instance of this daemon is already running" in lines[0], lines


def test_a_failed_context_check_quits_the_daemon_it_started(tmp_path):
    control, record = fake_control(tmp_path)
    lines = []
    daemon = start_mps("cuda", lines.append, control=control, environ={"PATH": os.environ["PATH"]},
                       check=lambda daemon: "a CUDA context through it failed: cuInit: CUDA_ERROR_MPS_CONNECTION_FAILED")
    assert daemon is None
    assert len(lines) == 1 and "CUDA_ERROR_MPS_CONNECTION_FAILED" in lines[0] and "without MPS" in lines[0]
    calls = record.read_text().splitlines()
    assert calls[0].startswith("daemon ") and calls[1].startswith("command quit to ")
    assert not Path(calls[0].split()[1]).exists(), "the daemon's folder is removed"


def test_a_started_daemon_reaches_the_stage_processes_with_their_percentages_and_is_quit_on_stop(tmp_path, monkeypatch):
    control, record = fake_control(tmp_path)
    lines = []
    daemon = start_mps("cuda:0", lines.append, control=control, environ={"PATH": os.environ["PATH"]},
                       check=lambda daemon: None)
    assert daemon is not None and daemon.owned and len(lines) == 1 and "control daemon started" in lines[0]
    assert (Path(daemon.pipe_dir) / "control").exists()

    spawned = {}  # module -> the environment its process got

    class FakePopen:
        def __init__(self, argv, env, **_):
            spawned[argv[2]] = env
            self.stdout = iter(())

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)  # the launcher's spawns only: undone before stop()
    percent = MpsPercent(thinker=70, talker=45, code2wav=25)
    stack = Stack(StackOptions(checkpoint="unused", device="cuda", gpu_sharing=GpuSharing.MPS, mps_percent=percent),
                  mps=daemon)
    for stage in (*Stage, "router", "gateway"):
        stack._add(f"{stage}-0", stage, [])
    for stage in Stage:
        env = spawned[launcher.STAGE_MODULES[stage]]
        assert (env[PIPE_ENV], env[LOG_ENV], env[PERCENT_ENV]) == (daemon.pipe_dir, daemon.log_dir,
                                                                   str(percent.of(stage))), stage
        assert env["PYTHONUNBUFFERED"] == "1"
    for service in ("router", "gateway"):  # no GPU in them: nothing of MPS
        assert PERCENT_ENV not in spawned[launcher.STAGE_MODULES[service]], service
    monkeypatch.undo()
    stack.stop()
    assert stack.mps is None
    assert record.read_text().splitlines()[-1] == f"command quit to {daemon.pipe_dir}"
    assert not Path(daemon.folder).exists()


def test_a_running_daemon_named_by_the_environment_is_joined_and_left_running(tmp_path):
    control, record = fake_control(tmp_path)
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    os.mkfifo(pipe / "control")
    lines = []
    daemon = start_mps("cuda", lines.append, control=control, check=lambda daemon: None,
                       environ={"PATH": os.environ["PATH"], PIPE_ENV: str(pipe), LOG_ENV: "/var/log/mps"})
    assert daemon == MpsDaemon(str(pipe), "/var/log/mps", owned=False, control=control)
    assert len(lines) == 1 and "joined" in lines[0]
    daemon.stop()
    assert not record.exists(), "a joined daemon is neither started nor quit"
    assert daemon.client_env(40) == {PIPE_ENV: str(pipe), LOG_ENV: "/var/log/mps", PERCENT_ENV: "40"}


def test_percentages_outside_1_to_100_are_refused_naming_the_flag():
    with pytest.raises(UserError, match="--mps-talker-percent must be within 1..100, got 0"):
        MpsPercent(talker=0)


def test_omni_serve_parses_the_sharing_flags_into_the_stack_options(tiny_checkpoint):
    parser = launcher.argparse.ArgumentParser()
    launcher._add_stack_flags(parser)
    args = parser.parse_args(["--checkpoint", str(tiny_checkpoint), "--gpu-sharing", "mps", "--mps-thinker-percent", "80"])
    options = launcher._options(args)
    assert options.gpu_sharing is GpuSharing.MPS
    assert options.mps_percent == MpsPercent(thinker=80)


@pytest.mark.slow  # a stack of its own: ~20 s of 2 cores
def test_a_stack_asked_for_mps_where_it_is_missing_logs_one_line_and_serves(tiny_checkpoint, tmp_path, capfd):
    """This machine has no nvidia-cuda-mps-control: the stack says so once and serves without it.
    (Its options name cuda so the missing program is the reason; the stages run on the CPU.)"""
    from services.tools.client import build_request, collect, connect
    from tests.stacks import stack_of

    with stack_of(tiny_checkpoint, device="cuda", gpu_sharing=GpuSharing.MPS) as stack:
        assert stack.mps is None
        channel, stub = connect(stack.target)
        result = collect(stub, build_request("Hi", max_new_tokens=3, talker_max_new_tokens=6), timeout=120)
        channel.close()
        for process in stack.processes.values():
            environ = Path(f"/proc/{process.popen.pid}/environ").read_bytes().split(b"\0")
            assert not any(line.startswith(PERCENT_ENV.encode()) for line in environ), process.name
    assert result.audio_seconds > 0
    lines = [line for line in capfd.readouterr().err.splitlines() if "--gpu-sharing mps" in line]
    assert len(lines) == 1 and "nvidia-cuda-mps-control is not on PATH" in lines[0], lines
