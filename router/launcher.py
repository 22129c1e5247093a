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
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import UserError, run_cli

STAGE_MODULES = {
    "code2wav": "services.code2wav.server",
    "talker": "services.talker.server",
    "thinker": "services.thinker.server",
    "router": "router.server",
}


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    port_file: Path
    port: int | None = None


@dataclass
class StackOptions:
    checkpoint: str
    port: int = 50051
    host: str = "127.0.0.1"
    threads: int = 0  # torch threads per stage process; 0 = cores / 3, at least 1
    thinker_args: tuple[str, ...] = ()
    talker_args: tuple[str, ...] = ()
    code2wav_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    startup_timeout_s: float = 180.0
    log_prefix: bool = True


@dataclass
class Stack:
    """The four processes. Use as a context manager, or start() / stop()."""

    options: StackOptions
    processes: dict[str, Process] = field(default_factory=dict)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="omni-serve-")))

    @property
    def target(self) -> str:
        return f"{self.options.host}:{self.processes['router'].port}"

    def port(self, name: str) -> int:
        return self.processes[name].port

    def _spawn(self, name: str, args: list[str]) -> Process:
        port_file = self.workdir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        popen = subprocess.Popen(
            [sys.executable, "-m", STAGE_MODULES[name], *args, "--port-file", str(port_file)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True,
        )
        threading.Thread(target=self._pump, args=(name, popen), daemon=True).start()
        process = Process(name, popen, port_file)
        self.processes[name] = process
        return process

    def _pump(self, name: str, popen: subprocess.Popen) -> None:
        for line in popen.stdout:
            if self.options.log_prefix:
                sys.stderr.write(f"[{name:8}] {line}")

    def start_stage(self, name: str, extra: tuple[str, ...] = ()) -> Process:
        o = self.options
        threads = o.threads or max(1, (os.cpu_count() or 1) // 3)
        common = ["--checkpoint", o.checkpoint, "--host", o.host, "--port", "0", "--threads", str(threads)]
        return self._spawn(name, common + list(extra))

    def start(self) -> "Stack":
        o = self.options
        try:
            for name, extra in (("code2wav", o.code2wav_args), ("talker", o.talker_args), ("thinker", o.thinker_args)):
                self.start_stage(name, extra)
            for name in ("code2wav", "talker", "thinker"):
                self.wait_ready(name)
            addr = lambda n: f"{o.host}:{self.port(n)}"  # noqa: E731
            self._spawn("router", ["--host", o.host, "--port", str(o.port), "--thinker", addr("thinker"),
                                   "--talker", addr("talker"), "--code2wav", addr("code2wav"), *o.router_args])
            self.wait_ready("router")
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, name: str) -> int:
        """Wait for the port file, then for SERVING on grpc.health.v1."""
        process = self.processes[name]
        deadline = time.monotonic() + self.options.startup_timeout_s
        while time.monotonic() < deadline:
            if process.popen.poll() is not None:
                raise UserError(f"{name} exited with code {process.popen.returncode} during start-up (see its log)")
            if process.port is None and process.port_file.exists():
                process.port = int(process.port_file.read_text())
            if process.port is not None and health_status(f"{self.options.host}:{process.port}") == "SERVING":
                return process.port
            time.sleep(0.1)
        raise UserError(f"{name} did not become healthy within {self.options.startup_timeout_s:.0f} s")

    def stop(self, grace_s: float = 10.0) -> None:
        # The router first, so no new work reaches the stages.
        for name in ("router", "thinker", "talker", "code2wav"):
            process = self.processes.get(name)
            if process is not None and process.popen.poll() is None:
                process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def health_status(target: str, service: str = "", timeout: float = 1.0) -> str:
    with grpc.insecure_channel(target) as channel:
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


def _options(args) -> StackOptions:
    from services.common.checkpoint import check_folder

    check_folder(args.checkpoint)
    thinker = ("--default-max-new-tokens", str(args.thinker_max_new_tokens)) if args.thinker_max_new_tokens else ()
    talker = ("--default-max-new-tokens", str(args.talker_max_new_tokens)) if args.talker_max_new_tokens else ()
    return StackOptions(checkpoint=args.checkpoint, port=args.port, host=args.host, threads=args.threads,
                        thinker_args=thinker, talker_args=talker)


def up(args) -> None:
    stack = Stack(_options(args))
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    print(f"omni-serve: starting code2wav, talker, thinker, router from {args.checkpoint}", file=sys.stderr)
    stack.start()
    print(f"omni-serve: ready on {stack.target} (thinker :{stack.port('thinker')}, talker :{stack.port('talker')}, "
          f"code2wav :{stack.port('code2wav')}). Try:\n  .venv/bin/omni-client --target {stack.target} "
          f"--prompt 'Hello!' --out out/hello.wav\nCtrl-C stops everything.", file=sys.stderr)
    try:
        while not stopping.is_set():
            dead = [p.name for p in stack.processes.values() if p.popen.poll() is not None]
            if dead:
                raise UserError(f"{', '.join(dead)} exited; stopping the stack")
            stopping.wait(0.5)
    finally:
        print("omni-serve: stopping", file=sys.stderr)
        stack.stop()


def demo(args) -> None:
    from router.client import build_request, collect, connect
    from services.common.reference import write_wav

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
