"""How a stack comes up (services/tools/launcher.py `Stack.start` / `wait_ready`) and what readiness
says meanwhile, with processes that hold no model (seconds, not a stack's start)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.base.errors import UserError
from services.tools.launcher import (
    Process,
    Stack,
    StackOptions,
    _add_stack_flags,
    _options,
    free_port,
    health_status,
)

REPO = Path(__file__).resolve().parents[2]

SERVER = """
import asyncio
from services.serving.grpc_server import build_server, serve_until_signal

async def main():
    handle = build_server("127.0.0.1", 0, ("test.Kept",))
    await handle.set_serving(False, services=("test.Kept",))
    print(handle.port, flush=True)
    await serve_until_signal(handle, grace_s=1, started_services=("",))

asyncio.run(main())
"""


def test_a_service_left_out_of_started_services_stays_not_serving():
    # The router's omni.v1.Omni: keep_health alone marks it SERVING, once every stage has a replica;
    # serve_until_signal used to mark it SERVING with everything else first.
    server = subprocess.Popen([sys.executable, "-c", SERVER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{int(server.stdout.readline())}"
        deadline = time.monotonic() + 30
        while health_status(address) != "SERVING":
            assert time.monotonic() < deadline, "the server never served"
            time.sleep(0.05)
        assert health_status(address, "test.Kept") == "NOT_SERVING"
    finally:
        server.kill()
        server.wait(timeout=10)


def test_a_router_without_a_stage_replica_is_live_but_never_ready():
    dead = [f"127.0.0.1:{free_port()}" for _ in range(3)]  # nothing listens there
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "router.server", "--host", "127.0.0.1", "--port", str(port),
                               "--poll-interval-s", "0.1", "--thinker", dead[0], "--talker", dead[1], "--code2wav", dead[2]],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address, seen = f"127.0.0.1:{port}", []
    try:
        deadline = time.monotonic() + 30
        while health_status(address, timeout=0.5) != "SERVING":  # liveness
            assert time.monotonic() < deadline and router.poll() is None, "the router never served"
        for _ in range(20):  # readiness, from the first moment it answers and for a while after
            seen.append(health_status(address, "omni.v1.Omni", timeout=0.5))
            time.sleep(0.05)
    finally:
        router.kill()
        router.wait(timeout=10)
    assert set(seen) == {"NOT_SERVING"}, seen


def fake_stack(tmp_path, **commands: list[str]) -> Stack:
    """A Stack of plain processes (name -> command), none of which answers health checks."""
    stack = Stack(StackOptions(checkpoint=str(tmp_path), port=0, log_prefix=False, startup_timeout_s=60))
    for name, command in commands.items():
        process = Process(name, name.split("-")[0], [], free_port())
        process.popen = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        stack.processes[name] = process
        threading.Thread(target=process.output.extend, args=(process.popen.stdout,), daemon=True).start()  # the pump
    return stack


def test_start_up_fails_at_once_naming_a_stage_the_router_cannot_do_without(tmp_path):
    # A stage that dies after it served used to leave the router waiting for it until the deadline
    # ("router did not become healthy within 180 s"), its log nowhere.
    stack = fake_stack(tmp_path, **{"thinker-0": [sys.executable, "-c", "print('thinker: out of memory'); exit(3)"],
                                    "talker-0": [sys.executable, "-c", "print('talker: gone'); exit(4)"],
                                    "talker-1": ["sleep", "60"]})
    for name in ("thinker-0", "talker-0"):
        stack.processes[name].popen.wait()
    time.sleep(0.5)  # their last lines pumped
    router = Process("router", "router", [], free_port())
    router.popen = subprocess.Popen(["sleep", "60"])
    stack.processes["router"] = router
    started = time.monotonic()
    try:
        with pytest.raises(UserError, match="thinker-0 exited with code 3 while router was starting, which cannot be "
                                            "ready without it(?s:.*)thinker: out of memory"):
            stack.wait_ready("router", peers=True)
        assert time.monotonic() - started < 10
        # A stage with a replica left is no reason: talker-1 still runs (omni-serve up restarts talker-0
        # once it supervises). Without `peers` (a restart) only its own exit counts; the router's
        # timeout says what its polls of the stages get.
        del stack.processes["thinker-0"]
        with pytest.raises(UserError, match=r"router did not become healthy within 1 s \(--startup-timeout-s\); what "
                                            "the router polls, asked now: talker-0 health UNAVAILABLE, talker-1 "
                                            "health UNAVAILABLE"):
            stack.wait_ready("router", timeout_s=1, peers=True)
    finally:
        for process in (router, stack.processes["talker-1"]):
            process.popen.kill()
            process.popen.wait()


def test_a_stage_not_healthy_in_time_is_named_with_what_it_was_doing(tmp_path):
    # omni-serve up said "code2wav-0 did not become healthy within 180 s (see its log)", its log
    # thousands of lines up; the timeout was not a flag.
    stack = fake_stack(tmp_path, **{"code2wav-0": [sys.executable, "-u", "-c", "print('loading weights'); "
                                                   "print('code2wav blocks: checking'); print(); "
                                                   "import time; time.sleep(60)"]})
    stack.options.log_prefix = True  # as omni-serve up runs: the log went to stderr
    try:
        deadline = time.monotonic() + 30
        while len(stack.processes["code2wav-0"].output) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(UserError, match=r"code2wav-0 did not become healthy within 1 s \(--startup-timeout-s\); "
                                            r"its last log line: code2wav blocks: checking \(see its log\)"):
            stack.wait_ready("code2wav-0", timeout_s=1)
    finally:
        stack.processes["code2wav-0"].popen.kill()
        stack.processes["code2wav-0"].popen.wait()


def test_the_start_up_timeout_is_a_flag(tiny_checkpoint):
    parser = argparse.ArgumentParser()
    _add_stack_flags(parser)
    assert _options(parser.parse_args(["--checkpoint", str(tiny_checkpoint)])).startup_timeout_s == 180
    assert _options(parser.parse_args(["--checkpoint", str(tiny_checkpoint), "--startup-timeout-s", "900"])
                    ).startup_timeout_s == 900
    with pytest.raises(UserError, match="--startup-timeout-s must be above 0, got 0"):
        _options(parser.parse_args(["--checkpoint", str(tiny_checkpoint), "--startup-timeout-s", "0"]))


def test_the_supervisor_restarts_one_replica_while_another_is_starting_and_kills_one_that_never_serves(
        tmp_path, monkeypatch):
    # omni-serve up's supervisor used to wait for each restart (up to the start-up timeout) and
    # sleep each backoff, handling no other exit meanwhile, and never said "SERVING again" of a
    # process that came up after its wait. Plain processes stand in for the replicas here: a
    # restart starts `sleep 60`, and serving is what the test says.
    stack = fake_stack(tmp_path, **{"talker-0": ["sleep", "60"], "talker-1": ["sleep", "60"]})
    stack.options.startup_timeout_s = 2.0
    launched: list[str] = []

    def launch(process):
        process.popen = subprocess.Popen(["sleep", "60"])
        launched.append(process.name)

    serving: set[str] = set()
    monkeypatch.setattr(stack, "_launch", launch)
    monkeypatch.setattr(stack, "_serving", lambda process: process.name in serving)
    stopping, log = threading.Event(), []
    supervisor = threading.Thread(target=stack.supervise, args=(stopping,), kwargs=dict(log=log.append), daemon=True)
    supervisor.start()

    def wait_logged(text: str, timeout_s: float = 10.0, times: int = 1) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(text in line for line in log) < times:
            assert time.monotonic() < deadline and supervisor.is_alive(), (text, log)
            time.sleep(0.02)

    try:
        stack.processes["talker-0"].popen.kill()  # restarted, then never serves
        wait_logged("talker-0 exited with code -9; restarting it")
        while launched != ["talker-0"]:
            time.sleep(0.02)
        stack.processes["talker-1"].popen.kill()  # while talker-0 is starting
        wait_logged("talker-1 exited with code -9; restarting it")
        while "talker-1" not in launched:
            time.sleep(0.02)
        serving.add("talker-1")
        wait_logged("talker-1 is SERVING again")
        assert not any("talker-0 is SERVING" in line for line in log), log
        wait_logged("talker-0 did not become healthy within 2 s of its restart (--startup-timeout-s)")
        wait_logged("talker-0 exited with code -9; restarting it on port", timeout_s=5.0, times=2)  # the kill, an exit
    finally:
        stopping.set()
        supervisor.join(timeout=10)
        for process in stack.processes.values():
            process.popen.kill()
            process.popen.wait()
    assert not supervisor.is_alive()
