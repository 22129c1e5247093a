"""`omni-serve`: run the whole stack locally as separate processes.

`omni-serve up --checkpoint DIR [--port P]` starts code2wav, talker, thinker and the router,
each its own process on its own port, waits until every one reports SERVING on grpc.health.v1,
prefixes their logs, and stops them all on Ctrl-C or SIGTERM. `omni-serve demo` does the same,
turns one prompt into a .wav through the router, and stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.runtime.checkpoint import check_folder
from services.runtime.errors import UserError, run_cli
from services.serving.security import TLSConfig, secure_or_insecure_channel
from services.tools.client import build_request, collect, connect
from services.tools.reference import write_wav

STAGE_MODULES = {
    "code2wav": "services.code2wav.server",
    "talker": "services.talker.server",
    "thinker": "services.thinker.server",
    "router": "router.server",
}


@dataclass
class Process:
    name: str  # "thinker-0", "talker-1", "router", ...
    stage: str
    args: list[str]
    port: int
    popen: subprocess.Popen | None = None
    output: deque = field(default_factory=lambda: deque(maxlen=5000))  # its last log lines


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class StackOptions:
    checkpoint: str
    port: int = 50051
    host: str = "127.0.0.1"
    threads: int = 0  # torch threads per stage process; 0 = cores / 3, at least 1
    thinker_replicas: int = 1
    talker_replicas: int = 1
    code2wav_replicas: int = 1
    thinker_args: tuple[str, ...] = ()
    talker_args: tuple[str, ...] = ()
    code2wav_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()  # appended to every process (e.g. TLS flags)
    tls: TLSConfig = TLSConfig()  # how the launcher itself reaches the processes (health checks)
    startup_timeout_s: float = 180.0
    log_prefix: bool = True


@dataclass
class Stack:
    """Every stage replica and the router as processes. A context manager, or start() / stop().

    Replicas get fixed ports chosen at start, so a killed replica can be restarted on its address
    (tests do that to check the router takes it back)."""

    options: StackOptions
    processes: dict[str, Process] = field(default_factory=dict)  # name -> process, in start order

    @property
    def target(self) -> str:
        return f"{self.options.host}:{self.processes['router'].port}"

    def port(self, name: str) -> int:
        return self.processes[name if name in self.processes else f"{name}-0"].port

    def addresses(self, stage: str) -> list[str]:
        return [f"{self.options.host}:{p.port}" for p in self.processes.values() if p.stage == stage]

    def _launch(self, process: Process) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        process.popen = subprocess.Popen(
            [sys.executable, "-m", STAGE_MODULES[process.stage], *process.args, *self.options.extra_args,
             "--port", str(process.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True,
        )
        threading.Thread(target=self._pump, args=(process, process.popen), daemon=True).start()

    def _pump(self, process: Process, popen: subprocess.Popen) -> None:
        for line in popen.stdout:
            process.output.append(line)
            if self.options.log_prefix:
                sys.stderr.write(f"[{process.name:10}] {line}")

    def _add(self, name: str, stage: str, args: list[str], port: int | None = None) -> Process:
        process = Process(name, stage, args, port or free_port(self.options.host))
        self.processes[name] = process
        self._launch(process)
        return process

    def start(self) -> Stack:
        o = self.options
        threads = o.threads or max(1, (os.cpu_count() or 1) // 3)
        common = ["--checkpoint", o.checkpoint, "--host", o.host, "--threads", str(threads)]
        try:
            for stage, count, extra in (("code2wav", o.code2wav_replicas, o.code2wav_args),
                                        ("talker", o.talker_replicas, o.talker_args),
                                        ("thinker", o.thinker_replicas, o.thinker_args)):
                for i in range(count):
                    self._add(f"{stage}-{i}", stage, common + list(extra))
            for name in list(self.processes):
                self.wait_ready(name)
            router = ["--host", o.host, "--poll-interval-s", "0.5", *o.router_args]
            for stage in ("thinker", "talker", "code2wav"):
                router += [f"--{stage}", ",".join(self.addresses(stage))]
            self._add("router", "router", router, port=o.port or free_port(o.host))
            self.wait_ready("router")
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, name: str, timeout_s: float | None = None) -> int:
        """Wait until the process reports SERVING on grpc.health.v1 (the router: for omni.v1.Omni,
        which means every stage has a healthy replica)."""
        process = self.processes[name]
        service = "omni.v1.Omni" if process.stage == "router" else ""
        deadline = time.monotonic() + (timeout_s or self.options.startup_timeout_s)
        while time.monotonic() < deadline:
            if process.popen.poll() is not None:
                raise UserError(f"{name} exited with code {process.popen.returncode} during start-up (see its log)")
            if health_status(f"{self.options.host}:{process.port}", service, tls=self.options.tls) == "SERVING":
                return process.port
            time.sleep(0.1)
        raise UserError(f"{name} did not become healthy within {self.options.startup_timeout_s:.0f} s")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send a signal to one process (tests: kill -9 a replica, or SIGTERM to drain it)."""
        self.processes[name].popen.send_signal(sig)

    def restart(self, name: str) -> None:
        """Start a stopped process again on the same port and wait until it serves."""
        process = self.processes[name]
        if process.popen.poll() is None:
            raise RuntimeError(f"{name} is still running")
        self._launch(process)
        self.wait_ready(name)

    def stop(self, grace_s: float = 10.0) -> None:
        # The router first, so no new work reaches the stages.
        order = sorted(self.processes.values(), key=lambda p: p.stage != "router")
        for process in order:
            if process.popen is not None and process.popen.poll() is None:
                process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in order:
            if process.popen is None:
                continue
            try:
                process.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def health_status(target: str, service: str = "", timeout: float = 1.0, tls: TLSConfig = TLSConfig()) -> str:
    with secure_or_insecure_channel(target, tls, [], aio=False) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _add_stack_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="Qwen3-Omni checkpoint folder")
    parser.add_argument("--port", type=int, default=50051, help="router port (default 50051)")
    parser.add_argument("--host", default="127.0.0.1", help="address every process binds (default 127.0.0.1)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per stage (default cores/3)")
    parser.add_argument("--thinker-max-new-tokens", type=int, help="thinker default max new tokens")
    parser.add_argument("--talker-max-new-tokens", type=int, help="talker default max new tokens")
    parser.add_argument("--device", help="every stage's --device (e.g. cuda)")
    parser.add_argument("--dtype", help="every stage's --dtype (e.g. bfloat16)")
    parser.add_argument("--random-weights", action="store_true",
                        help="every stage builds its model from config.json with seeded random weights "
                             "(a folder from `omni-tiny-checkpoint --full-size --no-weights`)")
    parser.add_argument("--thinker-replicas", type=int, default=1)
    parser.add_argument("--talker-replicas", type=int, default=1)
    parser.add_argument("--code2wav-replicas", type=int, default=1)


def _options(args) -> StackOptions:
    check_folder(args.checkpoint, need_weights=not args.random_weights)
    every = (("--device", args.device) if args.device else ()) + (("--dtype", args.dtype) if args.dtype else ()) + (
        ("--random-weights",) if args.random_weights else ())
    thinker = ("--default-max-new-tokens", str(args.thinker_max_new_tokens)) if args.thinker_max_new_tokens else ()
    talker = ("--default-max-new-tokens", str(args.talker_max_new_tokens)) if args.talker_max_new_tokens else ()
    return StackOptions(checkpoint=args.checkpoint, port=args.port, host=args.host, threads=args.threads,
                        thinker_replicas=args.thinker_replicas, talker_replicas=args.talker_replicas,
                        code2wav_replicas=args.code2wav_replicas, thinker_args=every + thinker,
                        talker_args=every + talker, code2wav_args=every)


def up(args) -> None:
    stack = Stack(_options(args))
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    print(f"omni-serve: starting code2wav x{args.code2wav_replicas}, talker x{args.talker_replicas}, "
          f"thinker x{args.thinker_replicas}, router from {args.checkpoint}", file=sys.stderr)
    stack.start()
    stages = ", ".join(f"{s} {' '.join(stack.addresses(s))}" for s in ("thinker", "talker", "code2wav"))
    print(f"omni-serve: ready on {stack.target} ({stages}). Try:\n  .venv/bin/omni-client --target {stack.target} "
          f"--prompt 'Hello!' --out out/hello.wav\nCtrl-C stops everything.", file=sys.stderr)
    try:
        while not stopping.is_set():
            dead = [p.name for p in stack.processes.values() if p.popen is not None and p.popen.poll() is not None]
            if dead:
                raise UserError(f"{', '.join(dead)} exited; stopping the stack")
            stopping.wait(0.5)
    finally:
        print("omni-serve: stopping", file=sys.stderr)
        stack.stop()


def demo(args) -> None:
    with Stack(_options(args)) as stack:
        channel, stub = connect(stack.target)
        request = build_request(args.prompt, voice=args.voice, max_new_tokens=args.max_new_tokens,
                                talker_max_new_tokens=args.demo_talker_max_new_tokens)
        result = collect(stub, request, timeout=300)
        channel.close()
    write_wav(Path(args.out), result.audio, result.sample_rate)
    print(f"text: {result.text!r}")
    print(f"wrote {args.out}: {result.audio_seconds:.2f} s of audio in {len(result.audio_chunks)} chunks; "
          f"ttft {result.ttft_ms:.0f} ms, ttfp {result.ttfp_ms:.0f} ms, rtf {result.rtf:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-serve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start the stack and serve until Ctrl-C / SIGTERM")
    _add_stack_flags(p_up)
    p_demo = sub.add_parser("demo", help="start the stack, make one .wav, stop")
    _add_stack_flags(p_demo)
    p_demo.add_argument("--prompt", default="Hello! Please tell me a short story about a small robot.")
    p_demo.add_argument("--voice")
    p_demo.add_argument("--max-new-tokens", type=int, default=32)
    p_demo.add_argument("--demo-talker-max-new-tokens", type=int, default=100)
    p_demo.add_argument("--out", default="out/demo.wav")
    args = parser.parse_args(argv)
    return run_cli(lambda: up(args) if args.command == "up" else demo(args))


if __name__ == "__main__":
    sys.exit(main())
