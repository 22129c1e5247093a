"""`omni-serve`: run the whole stack locally as separate processes.

`omni-serve up --checkpoint DIR [--port P] [--http-port H]` starts code2wav, talker, thinker, the
router, the sessions service (realtime voice sessions, on --sessions-port, default 50052) and the
OpenAI-compatible HTTP gateway (on H, default 8000; 0 = no gateway), each its own
process on its own port, waits until every one reports SERVING on grpc.health.v1 (the gateway:
200 on /health), prefixes their logs, and stops them all on Ctrl-C or SIGTERM. On one machine
the launcher is the deployment, so it supervises as Kubernetes would: a process that exits is
restarted on its port with backoff while the rest keep serving (the router takes a replica back
once it is SERVING); only Ctrl-C / SIGTERM or a crash loop stops the stack. `omni-serve demo`
starts the stack (no gateway), turns one prompt into a .wav through the router, and stops.
`--gpu-sharing mps` runs the stages' kernels side by side on their one GPU through CUDA MPS
(services/tools/gpu_sharing.py), or says in one line why it cannot and runs without.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
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

from omni.v1 import common_pb2
from services.base.errors import UserError, run_cli
from services.base.families import Family, family_of
from services.base.stages import Stage
from services.runtime.model.checkpoint import check_folder, load_voices
from services.runtime.model.settings import on_unless_cuda
from services.serving.open_streams import LIGHT_LOAD_STREAMS
from services.serving.placement import cpu_list
from services.serving.security import TLSConfig, secure_or_insecure_channel, tls_from_args
from services.serving.stage_stubs import stage_stub
from services.tools.client import build_request, collect, connect
from services.tools.gpu_sharing import GpuSharing, MpsDaemon, MpsPercent, start_mps
from services.tools.reference import write_wav

STAGE_MODULES = {
    Stage.CODE2WAV: "services.code2wav.server",
    Stage.TALKER: "services.talker.server",
    Stage.THINKER: "services.thinker.server",
    "router": "router.server",
    "sessions": "sessions.server",
    "gateway": "gateway.server",
}


@dataclass
class Process:
    name: str  # "thinker-0", "talker-1", "router", ...
    stage: str
    args: list[str]
    port: int
    popen: subprocess.Popen | None = None
    output: deque = field(default_factory=lambda: deque(maxlen=5000))  # its last log lines
    cpus: frozenset[int] | None = None  # where it runs at light load (`cpu_layout`); None = anywhere


def cpu_layout(cpus: list[int], threads: int, talkers: int) -> tuple[list[frozenset[int]], frozenset[int]] | None:
    """CPU sets for the stack's processes at light load (each process's `--light-load-cpus`,
    services/serving/placement.py): each talker replica `threads` CPUs of its own (the last ones),
    every other process the rest; None when that leaves the rest no CPU.

    NOTE: why the talker. It is the stage that works the most per request (a codec LM step and
    the code predictor's 15 per frame, 85-90 % of a core at concurrency 1 on the tiny checkpoint)
    and the first chunk waits on it. Sharing cores, its steps were descheduled by the thinker's
    tokens and every process's gRPC work: on 2 cores a talker frame took 5.1-6.4 ms in the stack
    against 3.9 ms alone. On a CPU of its own: omni-bench (tiny, 2-core Xeon, two alternating
    runs each) TTFP p50 at concurrency 1 53/51 -> 45/43 ms and at 16 293/331 -> 211/211 ms.
    Letting the router and code2wav float over both cores gave back most of the TTFP gain
    (250-286 ms at 16). Held at every load, the layout cost throughput and continuity at 16, so
    it holds at light load only (services/serving/placement.py has those figures)."""
    need = talkers * threads
    if talkers < 1 or len(cpus) <= need:
        return None
    own = [frozenset(cpus[len(cpus) - (i + 1) * threads:len(cpus) - i * threads]) for i in range(talkers)]
    return own, frozenset(cpus[:len(cpus) - need])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_block(host: str = "127.0.0.1", count: int = 8, tries: int = 50) -> int:
    """A base port with `count` free ports from it (`--metrics-base-port`: the router takes the base,
    each stage process the next)."""
    for _ in range(tries):
        base = random.randint(20000, 60000)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free block of metrics ports")


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
    sessions_port: int = 0  # the sessions service's port (0 = any free one)
    sessions_args: tuple[str, ...] = ()
    http_port: int | None = None  # start the HTTP gateway on this port (0 = any free one); None = no gateway
    gateway_args: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()  # appended to every process (e.g. TLS flags)
    metrics_base_port: int = 0  # Prometheus ports: the router this one, each other process the next; 0 = off
    tls: TLSConfig = TLSConfig()  # how the launcher itself reaches the processes (health checks)
    startup_timeout_s: float = 180.0
    log_prefix: bool = True
    device: str = "cpu"  # where the stages run (their --device is in the per-stage args); for cpu_layout's auto
    cpu_layout: str = "auto"  # auto|on|off: the talker on CPUs of its own (`cpu_layout`); auto = on unless CUDA
    gpu_sharing: GpuSharing = GpuSharing.NONE  # mps: the stages' kernels side by side (services/tools/gpu_sharing.py)
    mps_percent: MpsPercent = MpsPercent()  # each stage process's share of the SMs under MPS


@dataclass
class Stack:
    """Every stage replica and the router as processes. A context manager, or start() / stop().

    Replicas get fixed ports chosen at start, so a killed replica can be restarted on its address
    (tests do that to check the router takes it back)."""

    options: StackOptions
    processes: dict[str, Process] = field(default_factory=dict)  # name -> process, in start order
    layout: tuple[list[frozenset[int]], frozenset[int]] | None = None  # (talker replicas' CPUs, the rest's)
    mps: MpsDaemon | None = None  # the MPS daemon the stage processes use (--gpu-sharing mps), while the stack runs

    @property
    def target(self) -> str:
        return f"{self.options.host}:{self.processes['router'].port}"

    @property
    def sessions_target(self) -> str:
        """The sessions service (omni.v1.Sessions: realtime voice sessions)."""
        return f"{self.options.host}:{self.processes['sessions'].port}"

    @property
    def http_url(self) -> str | None:
        """The gateway's base URL (`.../v1` is the OpenAI API), when one was started."""
        gateway = self.processes.get("gateway")
        return f"http://{self.options.host}:{gateway.port}" if gateway is not None else None

    def port(self, name: str) -> int:
        return self.processes[name if name in self.processes else f"{name}-0"].port

    def addresses(self, stage: str) -> list[str]:
        return [f"{self.options.host}:{p.port}" for p in self.processes.values() if p.stage == stage]

    def process_env(self, stage: str) -> dict[str, str]:
        """What a process of `stage` gets on top of the launcher's environment: under MPS a stage
        process its daemon's pipe and its active-thread percentage; the router and the gateway,
        which never touch the GPU, nothing of MPS."""
        env = {"PYTHONUNBUFFERED": "1"}
        if self.mps is not None and stage in tuple(Stage):
            env |= self.mps.client_env(self.options.mps_percent.of(stage))
        return env

    def _launch(self, process: Process) -> None:
        env = dict(os.environ, **self.process_env(process.stage))
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
        base = self.options.metrics_base_port
        if base:  # distinct ports: one OMNI_METRICS_PORT would give every process the same one
            offset = 0 if stage == "router" else 1 + sum(p.stage != "router" for p in self.processes.values())
            args = args + ["--metrics-port", str(base + offset)]
        cpus = None
        if self.layout is not None and stage != "gateway":  # the gateway takes no serving flags
            talkers, rest = self.layout
            cpus = talkers[int(name.rsplit("-", 1)[1])] if stage == Stage.TALKER else rest
            args = args + ["--light-load-cpus", cpu_list(cpus)]
        process = Process(name, stage, args, port or free_port(self.options.host), cpus=cpus)
        self.processes[name] = process
        self._launch(process)
        return process

    def start(self) -> Stack:
        o = self.options
        threads = o.threads or max(1, (os.cpu_count() or 1) // 3)
        common = ["--checkpoint", o.checkpoint, "--host", o.host, "--threads", str(threads)]
        if on_unless_cuda(o.cpu_layout, o.device):
            self.layout = cpu_layout(sorted(os.sched_getaffinity(0)), threads, o.talker_replicas)
        try:
            if o.gpu_sharing is GpuSharing.MPS:
                self.mps = start_mps(o.device, log=lambda message: print(f"omni-serve: {message}", file=sys.stderr))
            for stage, count, extra in ((Stage.CODE2WAV, o.code2wav_replicas, o.code2wav_args),
                                        (Stage.TALKER, o.talker_replicas, o.talker_args),
                                        (Stage.THINKER, o.thinker_replicas, o.thinker_args)):
                for i in range(count):
                    self._add(f"{stage}-{i}", stage, common + list(extra))
            for name in list(self.processes):
                self.wait_ready(name, peers=True)
            router = ["--host", o.host, "--poll-interval-s", "0.5", *o.router_args]
            for stage in Stage:
                router += [f"--{stage}", ",".join(self.addresses(stage))]
            self._add("router", "router", router, port=o.port or free_port(o.host))
            self.wait_ready("router", peers=True)
            self._add("sessions", "sessions", ["--host", o.host, "--router", self.target, *o.sessions_args],
                      port=o.sessions_port or free_port(o.host))
            self.wait_ready("sessions", peers=True)
            if o.http_port is not None:
                self._add("gateway", "gateway", ["--router", self.target, "--sessions", self.sessions_target,
                                                 "--host", o.host, "--checkpoint",
                                                 o.checkpoint, *gateway_voices(o.checkpoint), *o.gateway_args],
                          port=o.http_port or free_port(o.host))
                self.wait_ready("gateway", peers=True)
        except BaseException:
            self.stop()
            raise
        return self

    def describe_layout(self) -> str:
        if self.layout is None:
            why = ("--cpu-layout off" if self.options.cpu_layout == "off" else "CUDA" if self.options.cpu_layout == "auto"
                   and self.options.device.startswith("cuda") else "too few CPUs for a talker's own")
            return f"CPU layout: none ({why}); every process may run on any CPU"
        talkers, rest = self.layout
        own = ", ".join(f"talker-{i} on CPU {cpu_list(cpus)}" for i, cpus in enumerate(talkers))
        return (f"CPU layout at light load (at most {LIGHT_LOAD_STREAMS} streams open on a process): {own}; the other stage "
                f"processes and the router on CPU {cpu_list(rest)}; anywhere above that load")

    def wait_ready(self, name: str, timeout_s: float | None = None, peers: bool = False) -> int:
        """Wait until the process reports SERVING on grpc.health.v1 (the router: for omni.v1.Omni,
        which means every stage has a healthy replica). `peers` (start-up): the processes it needs
        must stay up meanwhile (the router: a replica of every stage; the gateway: the router); when
        they are gone, the exit is the error at once, rather than a router that waits for a stage
        until the deadline. Errors carry the process's last log lines."""
        process = self.processes[name]
        timeout_s = timeout_s or self.options.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.popen.poll() is not None:
                raise UserError(f"{name} exited with code {process.popen.returncode} during start-up"
                                f"{self._log_tail(process)}")
            if peers and (gone := self._gone_need(process)) is not None:
                raise UserError(f"{gone.name} exited with code {gone.popen.returncode} while {name} was starting, "
                                f"which cannot be ready without it{self._log_tail(gone)}")
            if self._serving(process):
                return process.port
            time.sleep(0.1)
        seen = "" if process.stage != "router" else "; what the router polls, asked now: " + ", ".join(
            f"{p.name} {poll_as_the_router(p.stage, f'{self.options.host}:{p.port}', self.options.tls)}"
            for p in self.processes.values() if p.stage in tuple(Stage))
        raise UserError(f"{name} did not become healthy within {timeout_s:.0f} s (--startup-timeout-s){seen}; "
                        f"{self._last_line(process)}{self._log_tail(process)}")

    def _serving(self, process: Process) -> bool:
        """Whether the process reports SERVING (grpc.health.v1: the router for omni.v1.Omni, every
        stage has a healthy replica), or the gateway answers /health."""
        if process.stage == "gateway":
            return http_ready(f"http://{self.options.host}:{process.port}/health")
        service = "omni.v1.Omni" if process.stage == "router" else ""
        return health_status(f"{self.options.host}:{process.port}", service, tls=self.options.tls) == "SERVING"

    def _gone_need(self, process: Process) -> Process | None:
        """A process that `process` needs to become ready and that has exited: for the router, the
        last replica of a stage; for the gateway and the sessions service, the router. None while it can still get ready."""
        if process.stage == "router":
            for stage in Stage:
                replicas = [p for p in self.processes.values() if p.stage == stage and p.popen is not None]
                if replicas and all(p.popen.poll() is not None for p in replicas):
                    return replicas[-1]
        else:  # the gateway and the sessions service: the router
            router = self.processes.get("router")
            if router is not None and router.popen is not None and router.popen.poll() is not None:
                return router
        return None

    @staticmethod
    def _last_line(process: Process) -> str:
        """What a process was doing: its last log line."""
        last = next((line.strip() for line in reversed(process.output) if line.strip()), None)
        return f"its last log line: {last}" if last else "it logged nothing"

    def _log_tail(self, process: Process, lines: int = 30) -> str:
        """The end of a process's log for an error message (with log_prefix its log is on stderr already)."""
        if self.options.log_prefix:
            return " (see its log)"
        tail = list(process.output)[-lines:]
        return f"; the last {len(tail)} lines of its log:\n" + "".join(tail) if tail else "; it logged nothing"

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

    def supervise(self, stopping: threading.Event, max_restarts: int = 5, window_s: float = 60.0,
                  log=lambda message: print(f"omni-serve: {message}", file=sys.stderr)) -> None:
        """Until `stopping` is set: restart every process that exits, on its port, after a backoff
        (0.5 s doubling to 8 s per recent restart); more than `max_restarts` exits of one process
        within `window_s` is a crash loop: UserError, and the caller stops the stack.

        Nothing here waits on one process: a backoff is a due time, and a restarted process is
        watched while the loop goes on (another that exits meanwhile is restarted in its turn). It
        is said to serve once it does; one that does not within the start-up timeout is killed,
        and its exit counts as one more."""
        exits: dict[str, list[float]] = {name: [] for name in self.processes}  # name -> recent exit times
        due: dict[str, float] = {}  # name -> when it starts again (exited, in its backoff)
        starting: dict[str, float] = {}  # name -> the deadline of a restarted process not serving yet
        while not stopping.is_set():
            for process in self.processes.values():
                name, now = process.name, time.monotonic()
                if name in due:
                    if now >= due[name]:
                        del due[name]
                        self._launch(process)
                        starting[name] = now + self.options.startup_timeout_s
                    continue
                code = process.popen.poll() if process.popen is not None else None
                if code is not None:
                    starting.pop(name, None)
                    recent = exits[name] = [t for t in exits[name] if now - t < window_s] + [now]
                    if len(recent) > max_restarts:
                        raise UserError(f"{name} exited {len(recent)} times within {window_s:.0f} s "
                                        f"(last code {code}): a crash loop; stopping the stack")
                    delay = min(0.5 * 2 ** (len(recent) - 1), 8.0)
                    log(f"{name} exited with code {code}; restarting it on port {process.port} in {delay:.1f} s "
                        f"(the other processes keep serving)")
                    due[name] = now + delay
                elif name in starting:
                    if self._serving(process):
                        del starting[name]
                        log(f"{name} is SERVING again")
                    elif now > starting[name]:
                        del starting[name]
                        log(f"{name} did not become healthy within {self.options.startup_timeout_s:.0f} s of its "
                            f"restart (--startup-timeout-s); {self._last_line(process)}; killing it"
                            f"{self._log_tail(process)}")
                        process.popen.kill()
            stopping.wait(0.1 if starting or due else 0.5)

    def stop(self, grace_s: float = 10.0) -> None:
        # The gateway, the sessions service and the router first, so no new work reaches the stages.
        order = sorted(self.processes.values(), key=lambda p: {"gateway": 0, "sessions": 1, "router": 2}.get(p.stage, 3))
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
        if self.mps is not None:  # after its clients: a daemon the launcher started is quit, a joined one kept
            self.mps.stop()
            self.mps = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def gateway_voices(checkpoint: str) -> tuple[str, ...]:
    """The gateway's --voices where its config.json reading cannot find them: a Qwen2.5-Omni
    checkpoint keeps its voices in spk_dict.pt (torch), which the gateway (no torch) does not read.
    Qwen3-Omni's are in config.json: nothing to add. (A later --voices in gateway_args wins.)"""
    if family_of(checkpoint) is not Family.QWEN2_5_OMNI:
        return ()
    return ("--voices", ",".join(load_voices(checkpoint)))


def health_status(target: str, service: str = "", timeout: float = 1.0, tls: TLSConfig = TLSConfig()) -> str:
    with secure_or_insecure_channel(target, tls, [], aio=False) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def poll_as_the_router(stage: str, target: str, tls: TLSConfig = TLSConfig(), timeout: float = 5.0) -> str:
    """What the router's poll of a stage replica gets (services/serving/replicas.py: health, then GetLoad),
    for an error message: 'health SERVING, GetLoad OK', or the status of the call that failed."""
    with secure_or_insecure_channel(target, tls, [], aio=False) as channel:
        try:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            return f"health {exc.code().name}"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
        try:
            stage_stub(stage, channel).GetLoad(common_pb2.LoadRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            return f"health {status}, GetLoad {exc.code().name}: {exc.details()}"
    return f"health {status}, GetLoad OK"


def http_ready(url: str, timeout: float = 1.0) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _add_stack_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint folder of either family (Qwen3-Omni or Qwen2.5-Omni; config.json model_type)")
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
    parser.add_argument("--sessions-port", type=int, default=50052,
                        help="the sessions service's port (realtime voice sessions; default 50052, 0 = any free one)")
    for service in ("router", "sessions", *Stage):
        parser.add_argument(f"--{service}-args", default="", metavar="'FLAGS'",
                            help=f"more flags for every {service} process, as one shell-quoted string "
                                 f"(e.g. --{service}-args '--grace-s 60'); see omni-{service} --help")
    parser.add_argument("--metrics-base-port", type=int, default=0,
                        help="serve Prometheus metrics: the router on this port, each stage process on the "
                             "next ones in start order (code2wav, talker, thinker replicas); 0 = off")
    parser.add_argument("--cpu-layout", choices=["auto", "on", "off"], default="auto",
                        help=f"on: while a process has at most {LIGHT_LOAD_STREAMS} streams open, each talker replica "
                             "runs on CPUs of its own (its --threads' worth, the last ones) and the other processes on "
                             "the rest (--light-load-cpus); anywhere above that. Skipped when it leaves them none. "
                             "auto (default): on unless --device is cuda")
    parser.add_argument("--gpu-sharing", choices=list(GpuSharing), default=GpuSharing.NONE.value,
                        help="mps: the stage processes on one GPU run their kernels side by side through CUDA MPS "
                             "(the launcher starts nvidia-cuda-mps-control -d in a folder of its own, or joins the daemon "
                             "CUDA_MPS_PIPE_DIRECTORY names, and quits a daemon it started on exit); where MPS cannot "
                             "start, one log line and the stack runs without it. none (default): each stage its own "
                             "CUDA context, time-sliced (docs/gpu.md, \"Stages sharing a GPU\")")
    for stage in Stage:
        parser.add_argument(f"--mps-{stage}-percent", type=int, default=getattr(MpsPercent(), stage.value),
                            help=f"with --gpu-sharing mps: the {stage}'s CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, the share of "
                                 f"the SMs its kernels may take (default %(default)s, a guess to be measured)")
    parser.add_argument("--startup-timeout-s", type=float, default=180.0,
                        help="how long each process may take to report SERVING, at start and after a restart "
                             "(default 180: a stage serves once its weights are loaded; exact mode's start-up checks "
                             "run beside serving)")
    parser.add_argument("--tls-cert", help="every process serves with this certificate (and presents it onward)")
    parser.add_argument("--tls-key", help="private key of --tls-cert")
    parser.add_argument("--tls-ca", help="CA of the pipeline: mutual TLS on every hop")


def _options(args) -> StackOptions:
    check_folder(args.checkpoint, need_weights=not args.random_weights)
    if not args.startup_timeout_s > 0:
        raise UserError(f"--startup-timeout-s must be above 0, got {args.startup_timeout_s}")
    every = (("--device", args.device) if args.device else ()) + (("--dtype", args.dtype) if args.dtype else ()) + (
        ("--random-weights",) if args.random_weights else ())
    thinker = ("--default-max-new-tokens", str(args.thinker_max_new_tokens)) if args.thinker_max_new_tokens else ()
    talker = ("--default-max-new-tokens", str(args.talker_max_new_tokens)) if args.talker_max_new_tokens else ()
    tls_flags = tuple(part for flag in ("tls_cert", "tls_key", "tls_ca") if getattr(args, flag)
                      for part in (f"--{flag.replace('_', '-')}", getattr(args, flag)))
    tls = tls_from_args(argparse.Namespace(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                                           tls_server_name=None))
    more = {service: tuple(shlex.split(getattr(args, f"{service}_args")))
            for service in ("router", "sessions", *Stage)}
    return StackOptions(checkpoint=args.checkpoint, port=args.port, host=args.host, threads=args.threads,
                        thinker_replicas=args.thinker_replicas, talker_replicas=args.talker_replicas,
                        code2wav_replicas=args.code2wav_replicas, thinker_args=every + thinker + more["thinker"],
                        talker_args=every + talker + more["talker"], code2wav_args=every + more["code2wav"],
                        router_args=more["router"], sessions_port=args.sessions_port,
                        sessions_args=more["sessions"], extra_args=tls_flags, tls=tls,
                        metrics_base_port=args.metrics_base_port, device=args.device or "cpu",
                        cpu_layout=args.cpu_layout, startup_timeout_s=args.startup_timeout_s,
                        gpu_sharing=GpuSharing(args.gpu_sharing),
                        mps_percent=MpsPercent(**{stage.value: getattr(args, f"mps_{stage}_percent") for stage in Stage}))


def up(args) -> None:
    import dataclasses

    stack = Stack(dataclasses.replace(_options(args), http_port=args.http_port or None))
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    print(f"omni-serve: starting code2wav x{args.code2wav_replicas}, talker x{args.talker_replicas}, "
          f"thinker x{args.thinker_replicas}, router, sessions{', gateway' if args.http_port else ''} from {args.checkpoint}",
          file=sys.stderr)
    stack.start()
    print(f"omni-serve: {stack.describe_layout()}", file=sys.stderr)
    stages = ", ".join(f"{s} {' '.join(stack.addresses(s))}" for s in Stage)
    print(f"omni-serve: ready on {stack.target} ({stages}). Try:\n  .venv/bin/omni-client --target {stack.target} "
          f"--prompt 'Hello!' --out out/hello.wav\nRealtime voice sessions (omni.v1.Sessions) on {stack.sessions_target} "
          "(docs/sessions.md)\n" + (
              f"OpenAI-compatible HTTP API on {stack.http_url}/v1 (docs/gateway.md)\n" if stack.http_url else "")
          + "Ctrl-C stops everything.", file=sys.stderr)
    try:
        stack.supervise(stopping)
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
    p_up.add_argument("--http-port", type=int, default=8000,
                      help="OpenAI-compatible HTTP gateway port (default 8000; 0 = no gateway)")
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
