"""The soak's mix: the kinds of request (normal, text only, cancelled at a random point, expiring
deadline, malformed, a slow reader, connection churn), one planned at random per turn of a worker
loop, the driver that runs the loops (`Soak`), and chaos (a talker replica killed and restarted)."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import grpc

from omni.v1 import omni_pb2
from services.tools.client import build_request
from services.tools.soak.call import Call, CancelPoint, CancelWhen, Code, method_for
from services.tools.soak.malformed import malformed_requests


class Kind(Enum):
    NORMAL = "normal"
    TEXT_ONLY = "text_only"
    CANCEL = "cancel"
    DEADLINE = "deadline"
    MALFORMED = "malformed"
    SLOW_READER = "slow_reader"  # takes each message late: the stages' sends wait on flow control
    CHURN = "churn"  # on a connection of its own, closed as the call ends or right after its first message


MIX = {Kind.NORMAL: 4, Kind.TEXT_ONLY: 2, Kind.CANCEL: 3, Kind.DEADLINE: 1, Kind.MALFORMED: 1,  # kind -> weight
       Kind.SLOW_READER: 1, Kind.CHURN: 1}


@dataclass(frozen=True)
class Planned:
    kind: Kind
    request: omni_pb2.GenerateRequest | bytes
    timeout: float
    expected: frozenset  # status codes this kind may end with
    cancel_at: CancelPoint | None = None
    what: str = ""  # the malformed case's name
    pause_s: float = 0.0  # a slow reader's wait after each message
    close_after: int = 0  # churn: its connection is closed after this many messages (0: once the call ended)


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
    if kind is Kind.SLOW_READER:
        request = build_request(prompt, max_new_tokens=rng.randint(4, 8), talker_max_new_tokens=rng.randint(20, 60))
        return Planned(kind, request, hang_timeout_s, frozenset({Code.OK} | anywhere), pause_s=rng.uniform(0.05, 0.2))
    if kind is Kind.CHURN:
        request = build_request(prompt, max_new_tokens=rng.randint(4, 12), talker_max_new_tokens=rng.randint(10, 60))
        close_after = rng.choice((0, 1))
        ends = {Code.OK, Code.CANCELLED} if close_after else {Code.OK}  # closed mid-stream: CANCELLED
        return Planned(kind, request, hang_timeout_s, frozenset(ends | anywhere), close_after=close_after)
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


def run_planned(channel: grpc.Channel, planned: Planned, connect: Callable[[], grpc.Channel] | None = None) -> Outcome:
    """One planned request to its end; churn opens its own connection with `connect`."""
    own = connect() if planned.kind is Kind.CHURN else None
    try:
        call = Call(method_for(own or channel, planned.request), planned.request, planned.timeout, planned.cancel_at,
                    _after_each_message(planned, own)).run()
    finally:
        if own is not None:
            own.close()
    hung = call.code is Code.DEADLINE_EXCEEDED and planned.kind is not Kind.DEADLINE
    # A request planned to be cancelled whose cancel point never came (the text ended before it,
    # as random weights may say <|im_end|> early) completes: that is no failure.
    never_cancelled = planned.kind is Kind.CANCEL and call.code is Code.OK and call.cancelled_at is None
    expected = (call.code in planned.expected or never_cancelled) and not hung
    return Outcome(planned.kind, call.code.name, expected, hung, call.seconds,
                   call.details, planned.what, bool(call.final is not None and call.final.migrations))


def _after_each_message(planned: Planned, own: grpc.Channel | None) -> Callable[[Call], None] | None:
    """What the client does once a message is read: a slow reader waits; churn may close its connection."""
    if planned.pause_s:
        return lambda call: time.sleep(planned.pause_s)
    if own is not None and planned.close_after:
        return lambda call: own.close() if call.messages >= planned.close_after else None
    return None


@dataclass
class Soak:
    channel: grpc.Channel
    duration_s: float
    workers: int
    seed: int
    hang_timeout_s: float
    chaos: bool
    connect: Callable[[], grpc.Channel]  # a new connection to the target (churn)
    outcomes: list[Outcome] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def worker(self, index: int, end: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        kinds, weights = zip(*MIX.items())
        while time.monotonic() < end:
            planned = plan(rng, rng.choices(kinds, weights)[0], self.hang_timeout_s, self.chaos)
            outcome = run_planned(self.channel, planned, self.connect)
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
