"""`omni-serve up` as a user runs it: one process that starts the stack, supervises it as
Kubernetes would (a replica that dies is restarted while the rest keep serving), gives every
process its own metrics port, and stops everything on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from services.tools.client import build_request, collect, connect
from services.tools.launcher import free_port, free_port_block, health_status
from tests.threads import torch_threads


def children(pid: int) -> dict[int, str]:
    """pid -> command line of the processes whose parent is `pid`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    return found


def wait_for(predicate, timeout_s: float, what: str, log: list[str] = ()) -> None:
    """Until `predicate()`; past `timeout_s` a failure that shows the end of omni-serve's `log`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}; omni-serve's log ends:\n" + "".join(log[-40:])
        time.sleep(0.2)


@pytest.mark.slow  # omni-serve up's own 7 processes, a kill and a restart: ~40 s of make test's 2 cores
def test_omni_serve_up_restarts_a_dead_replica_and_keeps_serving(tiny_checkpoint):
    port, metrics = free_port(), free_port_block()  # the metrics ports: the base and the next four
    launcher = subprocess.Popen(
        [sys.executable, "-m", "services.tools.launcher", "up", "--checkpoint", str(tiny_checkpoint),
         "--port", str(port), "--sessions-port", "0", "--threads", str(torch_threads(1)), "--talker-replicas", "2",
         "--metrics-base-port", str(metrics),
         "--router-args", "--max-in-flight 8 --max-migrations 2", "--talker-args", "--grace-s 5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(launcher.stdout), daemon=True).start()
    target = f"127.0.0.1:{port}"
    started: set[int] = set()
    try:
        wait_for(lambda: health_status(target, "omni.v1.Omni") == "SERVING", 180, "the router", log)
        # The sessions service and the gateway start once the router serves: the whole stack is up at this line.
        wait_for(lambda: any("omni-serve: ready on" in line for line in log), 180, "the stack", log)
        stages = children(launcher.pid)
        started |= set(stages)
        assert sum("services.talker.server" in c for c in stages.values()) == 2
        assert any("router.server" in c and "--max-in-flight 8" in c for c in stages.values())
        assert sum("sessions.server" in c for c in stages.values()) == 1
        # Every process has its own metrics port: the router the base one, then code2wav, talker x2, thinker,
        # the sessions service.
        for offset, metric in enumerate(["omni_router_requests"] + ["omni_stage_queue_depth"] * 4 + ["omni_session_open"]):
            body = urllib.request.urlopen(f"http://127.0.0.1:{metrics + offset}/metrics", timeout=5).read().decode()
            assert metric in body

        victim = next(pid for pid, c in stages.items() if "services.talker.server" in c)
        os.kill(victim, signal.SIGKILL)
        # A talker's start under make test-slow's load (other stacks starting beside it) took up to 40 s
        # in the suite's setups; its restart waits the same, so the bound is generous.
        wait_for(lambda: any("is SERVING again" in line for line in log), 240, "the talker's restart", log)
        assert any("exited with code -9; restarting it on port" in line for line in log), "".join(log[-20:])
        assert launcher.poll() is None, "the launcher stopped the stack"
        started |= set(children(launcher.pid))
        channel, stub = connect(target)
        with channel:
            results = [collect(stub, build_request(f"after the restart {i}", max_new_tokens=4,
                                                   talker_max_new_tokens=12), timeout=120) for i in range(4)]
        assert all(r.final is not None and len(r.audio) > 0 for r in results)
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    assert launcher.returncode == 0, "".join(log[-30:])
    assert not [pid for pid in started if Path(f"/proc/{pid}").exists()], "a process outlived omni-serve"
