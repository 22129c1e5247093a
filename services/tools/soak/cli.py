"""`omni-soak`: a bounded mix of requests against the stack for a given time, then a leak check.

The command (services/tools/soak/__init__.py says what it does) and its summary."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import grpc

from services.base.errors import UserError, run_cli
from services.serving.grpc_server import channel_options
from services.tools.launcher import Stack, StackOptions, free_port
from services.tools.memory import MemoryWatch
from services.tools.soak.leaks import STAGES, Settled, read_router_gauges, wait_settled
from services.tools.soak.mix import Outcome, Soak, chaos_monkey


@dataclass(frozen=True)
class Summary:
    duration_s: float
    requests: int
    completed: int  # OK
    migrated: int  # of those, requests that moved off a replica that died (a pause, nothing lost)
    rejected: int  # RESOURCE_EXHAUSTED
    cancelled: int  # CANCELLED: this client cancelled
    failed: dict  # status code name -> count, every other non-OK end (expected ones included)
    kinds: dict  # kind -> requests of it
    unexpected: dict  # "kind CODE" -> count of ends that kind never should have
    examples: dict  # "kind CODE" -> the status details of the first such unexpected end
    hung: int  # requests that ran into the hang bound, plus worker loops that never came back
    leaked: int  # streams / admitted requests still held after settling; must be 0
    busy: dict  # "stage address" -> (in_flight, running, queue_depth), or "unreachable", of replicas not idle at the end
    unreachable: list  # "stage address" of replicas whose load could not be read at the end
    settle_s: float
    memory: dict = field(default_factory=dict)  # process -> RSS of the first vs the last window (MemoryWatch.report)

    @property
    def ok(self) -> bool:
        return self.leaked == 0 and self.hung == 0 and not self.unexpected and not self.busy and not self.unreachable

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ok": self.ok}, sort_keys=True)

    def lines(self) -> list[str]:
        failed = ", ".join(f"{code} {n}" for code, n in sorted(self.failed.items())) or "0"
        unexpected = ", ".join(f"{what} {n}" for what, n in sorted(self.unexpected.items())) or "0"
        busy = f" (busy: {self.busy})" if self.busy else ""
        busy += f" (unreachable, counted as busy: {', '.join(self.unreachable)})" if self.unreachable else ""
        examples = [f"    {what}: {details}" for what, details in sorted(self.examples.items())]
        return [
            f"omni-soak: {self.requests} requests in {self.duration_s:.1f} s "
            f"({', '.join(f'{kind} {n}' for kind, n in self.kinds.items())})",
            f"  completed   {self.completed} ({self.migrated} after moving off a dead replica)",
            f"  rejected    {self.rejected}",
            f"  cancelled   {self.cancelled}",
            f"  failed      {failed}",
            f"  unexpected  {unexpected}",
            *examples,
            f"  hung        {self.hung}",
            f"  leaked      {self.leaked} (settled in {self.settle_s:.1f} s){busy}",
            *[f"  memory      {name}: {m['first_mb']:.0f} -> {m['last_mb']:.0f} MB ({m['growth_mb']:+.1f} MB, "
              f"first vs last {m['window_s']:.0f} s; peak {m['peak_mb']:.0f} MB)" for name, m in sorted(self.memory.items())],
            f"  result      {'OK' if self.ok else 'FAILED'}",
        ]


def summarize(outcomes: list[Outcome], stuck_workers: int, settled: Settled, duration_s: float) -> Summary:
    codes = Counter(o.code for o in outcomes)
    unexpected = [(f"{o.kind.value} {o.code}", f"{o.what}: {o.details}" if o.what else o.details)
                  for o in outcomes if not o.expected and not o.hung]
    skip = {"OK", "RESOURCE_EXHAUSTED", "CANCELLED"}
    return Summary(
        duration_s=duration_s, requests=len(outcomes), completed=codes["OK"], migrated=sum(o.migrated for o in outcomes),
        rejected=codes["RESOURCE_EXHAUSTED"],
        cancelled=codes["CANCELLED"], failed={c: n for c, n in sorted(codes.items()) if c not in skip},
        kinds=dict(sorted(Counter(o.kind.value for o in outcomes).items())),
        unexpected=dict(Counter(key for key, _ in unexpected)),
        examples={key: details for key, details in reversed(unexpected)},
        hung=sum(o.hung for o in outcomes) + stuck_workers, leaked=settled.leaked, busy=settled.busy(),
        unreachable=[f"{load.stage} {load.address}" for load in settled.loads if not load.reachable], settle_s=settled.seconds,
    )


def _stage_addresses(specs: list[str]) -> dict[str, tuple[str, ...]]:
    replicas: dict[str, list[str]] = {stage: [] for stage in STAGES}  # stage -> addresses
    for spec in specs:
        stage, _, address = spec.partition("=")
        if stage not in replicas or ":" not in address:
            raise UserError(f"--stage-address: expected stage=host:port with stage one of {', '.join(STAGES)}, "
                            f"got {spec!r}")
        replicas[stage].append(address)
    return {stage: tuple(addresses) for stage, addresses in replicas.items()}


def _pids(stack, specs: list[str]) -> dict:
    """name -> pid (or a callable giving the current pid of a process the soak may restart)."""
    pids = {}
    if stack is not None:
        for name, process in stack.processes.items():
            pids[name] = lambda process=process: process.popen.pid
    for spec in specs:
        name, _, pid = spec.partition("=")
        if not pid.isdigit():
            raise UserError(f"--watch-pid: expected name=PID, got {spec!r}")
        pids[name] = int(pid)
    return pids


def soak(args, log: Callable[[str], None]) -> Summary:
    stack = None
    metrics_url = args.router_metrics
    if args.target is None:
        metrics_port = free_port()
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        stack = Stack(StackOptions(
            checkpoint=args.checkpoint, port=0, threads=args.threads, talker_replicas=args.talker_replicas,
            router_args=("--max-in-flight", str(args.max_in_flight), "--max-queue", str(args.max_queue),
                         "--queue-timeout-s", str(args.queue_timeout_s), "--metrics-port", str(metrics_port)),
            log_prefix=args.verbose,
        ))
        log(f"omni-soak: starting a stack from {args.checkpoint} ({args.talker_replicas} talker replicas)")
        stack.start()
    try:
        target = args.target or stack.target
        if stack is not None:
            replicas = {stage: tuple(stack.addresses(stage)) for stage in STAGES}
        elif args.stage_address:
            replicas = _stage_addresses(args.stage_address)
        else:
            replicas = read_router_gauges(metrics_url).replicas
        log(f"omni-soak: {args.workers} workers for {args.duration_s:g} s against {target}"
            f"{' with chaos' if args.chaos else ''}")
        def connect() -> grpc.Channel:
            return grpc.insecure_channel(target, options=channel_options())

        channel = connect()
        watch = MemoryWatch(_pids(stack, args.watch_pid), args.memory_interval_s).start()
        # With a surviving talker replica, chaos's victims move to it and complete: UNAVAILABLE is a failure.
        run = Soak(channel, args.duration_s, args.workers, args.seed, args.hang_timeout_s,
                   args.chaos and args.talker_replicas < 2, connect)
        chaos = []
        started = time.monotonic()
        stuck = run.run(on_started=lambda end: chaos.append(chaos_monkey(stack, end, log)) if args.chaos else None)
        for thread in chaos:
            thread.join(timeout=120)
        elapsed = time.monotonic() - started
        settled = wait_settled(replicas, metrics_url, args.settle_s)
        watch.stop()
        channel.close()
        summary = summarize(list(run.outcomes), stuck, settled, elapsed)
        return replace(summary, memory=watch.report(args.memory_window_s))
    finally:
        if stack is not None:
            stack.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-soak", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="checkpoint folder for the stack omni-soak starts itself")
    parser.add_argument("--target", help="a running router's host:port instead of a stack of its own")
    parser.add_argument("--router-metrics", help="with --target: the router's Prometheus URL "
                                                 "(http://host:port/metrics), to find the stage replicas")
    parser.add_argument("--stage-address", action="append", default=[],
                        help="with --target: stage=host:port of a replica to check for leaks (repeatable)")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=6, help="request loops running at once (default 6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chaos", action="store_true", help="kill -9 talker-0 a third of the way in, then restart it")
    parser.add_argument("--hang-timeout-s", type=float, default=60.0,
                        help="a request that should always end and runs this long counts as hung (default 60)")
    parser.add_argument("--settle-s", type=float, default=10.0, help="time allowed for in-flight counts to reach 0")
    parser.add_argument("--talker-replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per stage (default cores/3)")
    parser.add_argument("--max-in-flight", type=int, default=4, help="router admission limit of its own stack")
    parser.add_argument("--max-queue", type=int, default=4)
    parser.add_argument("--queue-timeout-s", type=float, default=2.0)
    parser.add_argument("--watch-pid", action="append", default=[],
                        help="with --target: name=PID of a local process whose memory to report (repeatable)")
    parser.add_argument("--memory-interval-s", type=float, default=5.0, help="RSS sampling interval (default 5)")
    parser.add_argument("--memory-window-s", type=float, default=600.0,
                        help="memory growth compares the mean RSS of the first and the last window (default 600 s; "
                             "a third of the run when it is shorter)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    parser.add_argument("--verbose", action="store_true", help="show the stack's logs")
    args = parser.parse_args(argv)
    result: list[Summary] = []

    def run() -> None:
        if args.target is None and not args.checkpoint:
            raise UserError("give --checkpoint DIR (omni-soak starts a stack) or --target HOST:PORT")
        if args.target is not None and args.chaos:
            raise UserError("--chaos kills a replica of the stack omni-soak starts itself: drop --target")
        if args.target is not None and not (args.router_metrics or args.stage_address):
            raise UserError("with --target, give --router-metrics URL or --stage-address stage=host:port "
                            "so the leak check can read every stage's load")
        summary = soak(args, lambda line: print(line, file=sys.stderr, flush=True))
        print(summary.to_json() if args.json else "\n".join(summary.lines()), flush=True)
        result.append(summary)

    code = run_cli(run)
    if code == 0 and not result[0].ok:
        return 1
    return code
