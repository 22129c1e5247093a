"""`omni-soak`: a bounded mix of requests against the stack for a given time, then a leak check.

`omni-soak --checkpoint DIR --duration-s 60` starts its own stack (2 talker replicas, tight
admission limits); `--target HOST:PORT` uses a running router instead (with `--router-metrics URL`
or `--stage-address stage=host:port`, so it can read every stage's load at the end). Worker loops
send normal requests, text-only ones, ones cancelled at a random point, ones whose deadline
expires mid-stream and malformed ones; `--chaos` also kills a talker replica (SIGKILL) a third of
the way in and restarts it. Then it waits for the stack to settle and reads every stage
replica's `GetLoad`: `leaked` is the sum of their in-flight streams plus the router's admitted
requests, and must be 0. Prints the counts (one JSON line with `--json`); exits 1 if anything
leaked or hung, or a request ended in a way its kind never should.

The pieces (`Call`, `CancelPoint`, `malformed_requests`, `read_loads`, `wait_settled`) are what
the reliability tests (tests/reliability) use too.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from enum import Enum

import grpc

from omni.v1 import common_pb2, omni_pb2, stages_pb2_grpc
from services.runtime.errors import UserError, run_cli
from services.runtime.stages import Stage
from services.serving.grpc_server import channel_options
from services.tools.client import build_request
from services.tools.launcher import Stack, StackOptions, free_port
from services.tools.memory import MemoryWatch

STAGES = tuple(Stage)
GENERATE = "/omni.v1.Omni/Generate"
_LOAD_STUBS = {
    "thinker": stages_pb2_grpc.ThinkerStub,
    "talker": stages_pb2_grpc.TalkerStub,
    "code2wav": stages_pb2_grpc.Code2WavStub,
}
Code = grpc.StatusCode


# --- one call, watched and cancellable -----------------------------------------------------------

class CancelWhen(Enum):
    BEFORE_FIRST = "before_first"  # after `delay_s`, whatever has arrived (usually nothing)
    AFTER_TEXT = "after_text"  # once `count` text tokens have arrived
    AFTER_AUDIO = "after_audio"  # once `count` audio chunks have arrived


@dataclass(frozen=True)
class CancelPoint:
    when: CancelWhen
    count: int = 1
    delay_s: float = 0.0

    def reached(self, call: Call) -> bool:
        if self.when is CancelWhen.AFTER_TEXT:
            return call.texts >= self.count
        if self.when is CancelWhen.AFTER_AUDIO:
            return call.audios >= self.count
        return False


class Call:
    """One `Omni/Generate` call, run to its end by `run()` on the calling thread.

    Other threads may read its progress (`texts`: text tokens, `audios`: chunks) or `cancel()` it. `method` is a stub's
    `Generate`, or a raw `channel.unary_stream(GENERATE)` for a request given as bytes. `on_response(call)`, if
    given, runs on the calling thread after each response is counted and before the cancel point is checked
    (a test reads the stages' loads there while the request is certainly still running)."""

    def __init__(self, method, request, timeout: float, cancel_at: CancelPoint | None = None,
                 on_response: Callable[[Call], None] | None = None):
        self.method = method
        self.request = request
        self.timeout = timeout
        self.cancel_at = cancel_at
        self.on_response = on_response
        self.texts = self.audios = self.messages = 0
        self.final: omni_pb2.Final | None = None
        self.code: grpc.StatusCode | None = None  # None while running
        self.details = ""
        self.error: grpc.RpcError | None = None  # how it failed (status details: error_info and the like)
        self.started = self.first_message = self.ended = None  # perf_counter times
        self.cancelled_at: float | None = None
        self.done = threading.Event()
        self._call = None
        self._lock = threading.Lock()

    def run(self) -> Call:
        self.started = time.perf_counter()
        try:
            with self._lock:
                self._call = self.method(self.request, timeout=self.timeout)
                cancel_now = self.cancelled_at is not None
            if cancel_now:
                self._call.cancel()
            point = self.cancel_at
            if point is not None and point.when is CancelWhen.BEFORE_FIRST:
                time.sleep(point.delay_s)
                self.cancel()
            for response in self._call:
                self._note(response)
                if self.on_response is not None:
                    self.on_response(self)
                if point is not None and point.reached(self):
                    self.cancel()
            self.code = Code.OK
        except grpc.RpcError as exc:
            self.code, self.details, self.error = exc.code(), exc.details() or "", exc
        self.ended = time.perf_counter()
        self.done.set()
        return self

    def _note(self, response) -> None:
        self.messages += 1
        if self.first_message is None:
            self.first_message = time.perf_counter()
        kind = response.WhichOneof("event") if isinstance(response, omni_pb2.GenerateResponse) else None
        if kind == "text":
            self.texts += len(response.text.token_ids)  # a delta carries one or more tokens
        elif kind == "audio":
            self.audios += 1
        elif kind == "final":
            self.final = response.final

    def cancel(self) -> None:
        with self._lock:
            if self.cancelled_at is None:
                self.cancelled_at = time.perf_counter()
            if self._call is not None:
                self._call.cancel()

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


# --- malformed requests --------------------------------------------------------------------------

@dataclass(frozen=True)
class Malformed:
    request: omni_pb2.GenerateRequest | bytes  # bytes go through a raw call, unparsed
    code: grpc.StatusCode
    names: str  # what the status details must contain
    before_output: bool = True  # refused before any response message


def _sampling(request: omni_pb2.GenerateRequest, stage: str, **values) -> omni_pb2.GenerateRequest:
    for key, value in values.items():
        setattr(getattr(request, f"{stage}_sampling"), key, value)
    return request


def _modalities(request: omni_pb2.GenerateRequest, *modalities: int) -> omni_pb2.GenerateRequest:
    del request.output_modalities[:]
    request.output_modalities.extend(modalities)
    return request


def malformed_requests() -> dict[str, Malformed]:
    """Requests the stack must refuse, by name: INVALID_ARGUMENT naming the field (`request` for bytes
    that are no GenerateRequest at all)."""
    no_content = omni_pb2.GenerateRequest()
    no_content.messages.add(role=omni_pb2.ROLE_USER)
    empty_part = omni_pb2.GenerateRequest()
    empty_part.messages.add(role=omni_pb2.ROLE_USER).content.add()
    no_role = build_request("hi")
    no_role.messages[0].role = omni_pb2.ROLE_UNSPECIFIED
    bad = Code.INVALID_ARGUMENT
    return {
        "no messages": Malformed(omni_pb2.GenerateRequest(), bad, "messages"),
        "message without content": Malformed(no_content, bad, "messages[0].content"),
        "empty content part": Malformed(empty_part, bad, "messages[0].content[0]"),
        "unspecified role": Malformed(no_role, bad, "messages[0].role"),
        "bad audio bytes": Malformed(build_request("hi", audio=b"RIFF not really a wav"), bad,
                                     "messages[0].content[0].audio"),
        "bad image bytes": Malformed(build_request("hi", image=b"\x89PNG garbage"), bad, "messages[0].content[0].image"),
        "unknown voice": Malformed(build_request("hi", voice="nobody"), bad, "voice"),
        "negative temperature": Malformed(_sampling(build_request("hi"), "thinker", temperature=-1.0), bad,
                                          "thinker_sampling.temperature"),
        "top_p above 1": Malformed(_sampling(build_request("hi"), "thinker", top_p=1.5), bad, "thinker_sampling.top_p"),
        "zero max_new_tokens": Malformed(_sampling(build_request("hi"), "thinker", max_new_tokens=0), bad,
                                         "thinker_sampling.max_new_tokens"),
        "huge max_new_tokens": Malformed(_sampling(build_request("hi"), "thinker", max_new_tokens=10**9), bad,
                                         "thinker_sampling.max_new_tokens"),
        "negative talker top_k": Malformed(_sampling(build_request("hi"), "talker", top_k=-3), bad,
                                           "talker_sampling.top_k"),
        "zero talker repetition_penalty": Malformed(_sampling(build_request("hi"), "talker", repetition_penalty=0.0),
                                                    bad, "talker_sampling.repetition_penalty"),
        "huge prompt": Malformed(build_request("hello " * 5000), bad, "prompt is"),
        "audio without text": Malformed(_modalities(build_request("hi"), omni_pb2.MODALITY_AUDIO), bad,
                                        "output_modalities"),
        "unknown modality": Malformed(_modalities(build_request("hi"), omni_pb2.MODALITY_TEXT, 7), bad,
                                      "output_modalities"),
        # The thinker checks the talker's limits too, so this is refused before any output.
        "talker max_new_tokens over its cache": Malformed(
            _sampling(build_request("hi"), "talker", max_new_tokens=5000), bad, "talker_sampling.max_new_tokens"),
        "empty bytes": Malformed(b"", bad, "messages"),  # parses: an empty GenerateRequest
        "garbage bytes": Malformed(b"\xff\xfe garbage \x00\x01", bad, "request: the body is not"),
        "truncated message": Malformed(build_request("hello there").SerializeToString()[:-3], bad,
                                       "request: the body is not"),
    }


def method_for(channel: grpc.Channel, request) -> Callable:
    """The Generate multi-callable for a request: typed, or raw bytes for unparsed ones."""
    if isinstance(request, bytes):
        return channel.unary_stream(GENERATE)
    return channel.unary_stream(GENERATE, request_serializer=omni_pb2.GenerateRequest.SerializeToString,
                                response_deserializer=omni_pb2.GenerateResponse.FromString)


# --- stage loads and the router's gauges ---------------------------------------------------------

@dataclass(frozen=True)
class StageLoad:
    stage: str
    address: str
    in_flight: int = 0  # streams open on the replica
    running: int = 0
    queue_depth: int = 0
    reachable: bool = True
    in_flight_peak: int = 0  # the most streams open at once since the start or the last reset (the stage's count)
    streams_total: int = 0  # streams opened since the process started (the stage's count)

    @property
    def idle(self) -> bool:
        """Whether the replica reported holding nothing. A replica whose load cannot be read (dead,
        stopped, hung) is never idle: nothing proves it let go of its work. Callers that killed a
        replica on purpose leave its address out of what they check."""
        return self.reachable and not (self.in_flight or self.running or self.queue_depth)


def read_load(stage: str, address: str, timeout: float = 1.0, reset_peak: bool = False) -> StageLoad:
    """The replica's GetLoad; `reset_peak` starts a new high-water mark after this report."""
    with grpc.insecure_channel(address) as channel:
        try:
            report = _LOAD_STUBS[stage](channel).GetLoad(common_pb2.LoadRequest(reset_peak=reset_peak), timeout=timeout)
        except grpc.RpcError:
            return StageLoad(stage, address, reachable=False)
    return StageLoad(stage, address, report.in_flight, report.running, report.queue_depth,
                     in_flight_peak=report.in_flight_peak, streams_total=report.streams_total)


def read_loads(replicas: dict[str, tuple[str, ...]]) -> list[StageLoad]:
    """Every replica's load; replicas: stage -> addresses. An unreachable one comes back with
    reachable=False, which counts as busy (StageLoad.idle)."""
    return [read_load(stage, address) for stage, addresses in replicas.items() for address in addresses]


@dataclass(frozen=True)
class RouterGauges:
    in_flight: int  # requests admitted and streaming
    queue_depth: int  # requests waiting for admission
    healthy: dict  # (stage, address) -> bool: SERVING and not draining, as the router sees it
    outcomes: dict  # outcome label -> requests counted
    reported: dict = field(default_factory=dict)  # (stage, address) -> queued + running at the router's last poll
    in_flight_peak: int = 0  # the most requests admitted at once since the router started (its own count)

    @property
    def replicas(self) -> dict[str, tuple[str, ...]]:
        """stage -> the addresses the router knows."""
        return {stage: tuple(a for s, a in sorted(self.healthy) if s == stage) for stage in STAGES}


def read_router_gauges(url: str, timeout: float = 2.0) -> RouterGauges:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    in_flight = queue_depth = peak = 0
    healthy, outcomes, reported = {}, {}, {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "omni_router_in_flight":
                in_flight = int(sample.value)
            elif sample.name == "omni_router_in_flight_peak":
                peak = int(sample.value)
            elif sample.name == "omni_router_queue_depth":
                queue_depth = int(sample.value)
            elif sample.name == "omni_router_replica_healthy":
                healthy[(sample.labels["stage"], sample.labels["replica"])] = sample.value == 1.0
            elif sample.name == "omni_router_requests_total":
                outcomes[sample.labels["outcome"]] = int(sample.value)
            elif sample.name == "omni_router_replica_reported_load":
                reported[(sample.labels["stage"], sample.labels["replica"])] = int(sample.value)
    return RouterGauges(in_flight, queue_depth, healthy, outcomes, reported, peak)


@dataclass(frozen=True)
class Settled:
    loads: tuple[StageLoad, ...]
    router: RouterGauges | None
    seconds: float  # how long settling took (or the whole wait, if it never did)

    @property
    def leaked(self) -> int:
        """Streams still open on the stages plus requests the router still counts as admitted."""
        router = self.router.in_flight + self.router.queue_depth if self.router is not None else 0
        return sum(load.in_flight for load in self.loads) + router

    @property
    def idle(self) -> bool:
        # The router's view counts too: a load it polled before the stages went idle would steer
        # the next requests away from those replicas.
        router_idle = self.router is None or (self.router.in_flight == 0 and self.router.queue_depth == 0
                                              and not any(self.router.reported.values()))
        return router_idle and all(load.idle for load in self.loads)

    def busy(self) -> dict[str, tuple[int, int, int] | str]:
        """'stage address' -> (in_flight, running, queue_depth) of every replica not idle, or
        'unreachable' for one whose load could not be read."""
        return {f"{load.stage} {load.address}": (load.in_flight, load.running, load.queue_depth) if load.reachable
                else "unreachable" for load in self.loads if not load.idle}


def wait_settled(replicas: dict[str, tuple[str, ...]], metrics_url: str | None = None,
                 timeout_s: float = 10.0) -> Settled:
    """Poll until every stage replica (and the router, given its metrics) holds nothing."""
    start = time.monotonic()
    while True:
        router = read_router_gauges(metrics_url) if metrics_url else None
        settled = Settled(tuple(read_loads(replicas)), router, time.monotonic() - start)
        if settled.idle or settled.seconds >= timeout_s:
            return settled
        time.sleep(0.1)


# --- the mix -------------------------------------------------------------------------------------

class Kind(Enum):
    NORMAL = "normal"
    TEXT_ONLY = "text_only"
    CANCEL = "cancel"
    DEADLINE = "deadline"
    MALFORMED = "malformed"


MIX = {Kind.NORMAL: 4, Kind.TEXT_ONLY: 2, Kind.CANCEL: 3, Kind.DEADLINE: 1, Kind.MALFORMED: 1}  # kind -> weight


@dataclass(frozen=True)
class Planned:
    kind: Kind
    request: omni_pb2.GenerateRequest | bytes
    timeout: float
    expected: frozenset  # status codes this kind may end with
    cancel_at: CancelPoint | None = None
    what: str = ""  # the malformed case's name


def plan(rng: random.Random, kind: Kind, hang_timeout_s: float, chaos: bool) -> Planned:
    """One request of a kind, sized for a tiny checkpoint (tens of milliseconds per token).
    `chaos`: a request may be on a replica that dies with no survivor to move to."""
    # Anything may meet a full router; with chaos and no survivor, a request may be on the replica that dies.
    anywhere = {Code.RESOURCE_EXHAUSTED} | ({Code.UNAVAILABLE} if chaos else set())
    prompt = f"soak request {rng.randrange(10**6)}: tell me about {rng.choice(['robots', 'rivers', 'bread'])}"
    if kind is Kind.NORMAL:
        request = build_request(prompt, max_new_tokens=rng.randint(4, 12), talker_max_new_tokens=rng.randint(10, 60))
        return Planned(kind, request, hang_timeout_s, frozenset({Code.OK} | anywhere))
    if kind is Kind.TEXT_ONLY:
        request = build_request(prompt, text_only=True, max_new_tokens=rng.randint(4, 16))
        return Planned(kind, request, hang_timeout_s, frozenset({Code.OK, Code.RESOURCE_EXHAUSTED}))
    if kind is Kind.CANCEL:
        text_tokens = 8
        request = build_request(prompt, max_new_tokens=text_tokens, talker_max_new_tokens=200)
        when = rng.choice(list(CancelWhen))
        count = rng.randint(1, text_tokens - 1) if when is CancelWhen.AFTER_TEXT else rng.randint(1, 2)
        point = CancelPoint(when, count, delay_s=rng.uniform(0.0, 0.05))
        return Planned(kind, request, hang_timeout_s, frozenset({Code.CANCELLED} | anywhere), point)
    if kind is Kind.DEADLINE:
        request = build_request(prompt, max_new_tokens=8, talker_max_new_tokens=400)
        return Planned(kind, request, rng.uniform(0.2, 0.5), frozenset({Code.DEADLINE_EXCEEDED} | anywhere))
    # Only what the stack refuses up front: one refused mid-stream can end INTERNAL (a known race).
    cases = {name: case for name, case in malformed_requests().items() if case.before_output}
    name = rng.choice(sorted(cases))
    return Planned(kind, cases[name].request, hang_timeout_s, frozenset({cases[name].code} | anywhere), what=name)


@dataclass(frozen=True)
class Outcome:
    kind: Kind
    code: str  # grpc status code name
    expected: bool
    hung: bool  # ran into the hang bound: a request that should always end did not
    seconds: float
    details: str = ""  # the status details
    what: str = ""  # which malformed case, for a malformed request
    migrated: bool = False  # completed after moving off a replica that died


def run_planned(channel: grpc.Channel, planned: Planned) -> Outcome:
    call = Call(method_for(channel, planned.request), planned.request, planned.timeout, planned.cancel_at).run()
    hung = call.code is Code.DEADLINE_EXCEEDED and planned.kind is not Kind.DEADLINE
    # A request planned to be cancelled whose cancel point never came (the text ended before it,
    # as random weights may say <|im_end|> early) completes: that is no failure.
    never_cancelled = planned.kind is Kind.CANCEL and call.code is Code.OK and call.cancelled_at is None
    expected = (call.code in planned.expected or never_cancelled) and not hung
    return Outcome(planned.kind, call.code.name, expected, hung, call.seconds,
                   call.details, planned.what, bool(call.final is not None and call.final.migrations))


@dataclass
class Soak:
    channel: grpc.Channel
    duration_s: float
    workers: int
    seed: int
    hang_timeout_s: float
    chaos: bool
    outcomes: list[Outcome] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def worker(self, index: int, end: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        kinds, weights = zip(*MIX.items())
        while time.monotonic() < end:
            planned = plan(rng, rng.choices(kinds, weights)[0], self.hang_timeout_s, self.chaos)
            outcome = run_planned(self.channel, planned)
            with self._lock:
                self.outcomes.append(outcome)

    def run(self, on_started: Callable[[float], None] | None = None) -> int:
        """Run the worker loops for the duration; returns how many never came back (hung)."""
        end = time.monotonic() + self.duration_s
        threads = [threading.Thread(target=self.worker, args=(i, end), name=f"soak-{i}", daemon=True)
                   for i in range(self.workers)]
        for thread in threads:
            thread.start()
        if on_started is not None:
            on_started(end)
        # A worker's last request started before `end` and is bounded by the hang timeout.
        join_by = end + self.hang_timeout_s + 5.0
        for thread in threads:
            thread.join(timeout=max(join_by - time.monotonic(), 0.0))
        return sum(thread.is_alive() for thread in threads)


def chaos_monkey(stack, end: float, log: Callable[[str], None]) -> threading.Thread:
    """Kill talker-0 with SIGKILL a third of the way to `end`, restart it two seconds later."""

    def run() -> None:
        kill_at = time.monotonic() + (end - time.monotonic()) / 3
        time.sleep(max(kill_at - time.monotonic(), 0.0))
        stack.kill("talker-0", signal.SIGKILL)
        stack.processes["talker-0"].popen.wait()
        log("chaos: killed talker-0 (SIGKILL)")
        time.sleep(2.0)
        started = time.monotonic()
        try:
            stack.restart("talker-0")
        except Exception as exc:  # reported, and the leak check still runs on the rest
            log(f"chaos: restarting talker-0 failed: {exc}")
            return
        log(f"chaos: talker-0 serving again after a {time.monotonic() - started:.1f} s restart")

    thread = threading.Thread(target=run, name="soak-chaos", daemon=True)
    thread.start()
    return thread


# --- the summary ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Summary:
    duration_s: float
    requests: int
    completed: int  # OK
    migrated: int  # of those, requests that moved off a replica that died (a pause, nothing lost)
    rejected: int  # RESOURCE_EXHAUSTED
    cancelled: int  # CANCELLED: this client cancelled
    failed: dict  # status code name -> count, every other non-OK end (expected ones included)
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
            f"omni-soak: {self.requests} requests in {self.duration_s:.1f} s",
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
        unexpected=dict(Counter(key for key, _ in unexpected)),
        examples={key: details for key, details in reversed(unexpected)},
        hung=sum(o.hung for o in outcomes) + stuck_workers, leaked=settled.leaked, busy=settled.busy(),
        unreachable=[f"{load.stage} {load.address}" for load in settled.loads if not load.reachable], settle_s=settled.seconds,
    )


# --- the command ---------------------------------------------------------------------------------

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
        channel = grpc.insecure_channel(target, options=channel_options())
        watch = MemoryWatch(_pids(stack, args.watch_pid), args.memory_interval_s).start()
        # With a surviving talker replica, chaos's victims move to it and complete: UNAVAILABLE is a failure.
        run = Soak(channel, args.duration_s, args.workers, args.seed, args.hang_timeout_s,
                   args.chaos and args.talker_replicas < 2)
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


if __name__ == "__main__":
    sys.exit(main())
