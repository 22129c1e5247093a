"""One engine loop per service, off the gRPC event loop.

gRPC handlers (asyncio) only convert and enqueue commands; a dedicated thread drains the
command queue, steps the model, and hands each event back to the handler's `EventSink` with
`call_soon_threadsafe`. Aborts travel through the same queue, so the engine itself is
single-threaded and needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

from omni.v1 import common_pb2
from services.base.engine import Engine
from services.base.errors import InvalidArgument
from services.base.events import EngineEvent, RequestFailed
from services.serving.status import EngineFailed, StreamIdle

log = logging.getLogger(__name__)


# Loop commands: what handlers ask of the loop thread.
@dataclass(frozen=True)
class Add:
    request_id: str
    payload: Any  # the engine's job for this request
    sink: EventSink


@dataclass(frozen=True)
class Input:
    request_id: str
    payload: Any  # more input for a running request (a text row, codec frames, an end mark)


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Wake:
    """Unblocks the loop thread (on stop)."""


Command = Add | Input | Abort | Wake


def engine_key(request_id: str) -> str:
    """The engine's key for one stream: the caller's request id made unique."""
    return f"{request_id}#{uuid.uuid4().hex[:12]}"


class EventSink:
    """Where one stream's items arrive: its engine's events (from the loop thread, `deliver`),
    the next stage's responses (from a relay task, `downstream`) and failures (`fail`). `get`
    returns events and responses and raises failures, so handlers deal with errors in one `except`.

    Two lanes, each in order: what comes from the next stage (responses, failures) is handed out
    before the engine's events. NOTE: why. A handler can fall behind its engine (the thinker makes
    a token every millisecond or two; passing each one on to the client and the talker costs the
    handler about as much), and audio coming up from the talker then waited behind every token
    queued before it: 9-14 ms of the first audio at concurrency 1 on 2 cores. Nothing depends on
    the order across lanes: a stage's outputs and its downstream's are independent streams, and
    each lane keeps its own order (a response, then the failure that ended its stream)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._engine: deque = deque()  # EngineEvent | _Failure, from the loop thread
        self._next_stage: deque = deque()  # protobuf message | _Failure, on the event loop
        self._ready = asyncio.Event()
        # Wall-clock ns at which the engine step that gave this stream its first event began (set
        # once, by the loop thread, before that event is handed over): the end of the request's
        # wait for a slot or input, for its `queue` span (services/serving/tracing.py).
        self.first_step_ns: int | None = None

    def deliver(self, event: EngineEvent | BaseException) -> None:
        """From the engine thread."""
        item = _Failure(event) if isinstance(event, BaseException) else event
        try:
            self._loop.call_soon_threadsafe(self._put_engine, item)
        except RuntimeError:  # the event loop closed: the caller is gone
            pass

    def _put_engine(self, item) -> None:
        self._engine.append(item)
        self._ready.set()

    def downstream(self, message) -> None:
        """A response of the next stage (on the event loop)."""
        self._next_stage.append(message)
        self._ready.set()

    def fail(self, exc: BaseException) -> None:
        """End the stream with `exc` (on the event loop)."""
        self._next_stage.append(_Failure(exc))
        self._ready.set()

    async def get(self, idle_timeout_s: float | None = None, stage: str = "stage"):
        """The next response or event; raises a failure put in, and StreamIdle when nothing comes
        for the idle timeout: no stage waits forever."""
        while not (self._next_stage or self._engine):
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), idle_timeout_s)
            except TimeoutError:
                raise StreamIdle(stage, idle_timeout_s) from None
        item = self._next_stage.popleft() if self._next_stage else self._engine.popleft()
        if isinstance(item, _Failure):
            raise item.error
        return item


@dataclass(frozen=True)
class _Failure:
    error: BaseException


class LoopStats:
    steps: int = 0
    step_ms_ewma: float = 0.0


class EngineLoop:
    def __init__(self, engine: Engine, name: str, metrics=None):
        self.engine = engine
        self.name = name
        self.metrics = metrics  # StageMetrics or None
        self.stats = LoopStats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, EventSink] = {}  # request_id -> where its events go
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)
        self.streams = None  # the server's OpenStreams: its open streams count as in flight too
        if metrics is not None:
            # Read at each scrape, as the load report reads it: its streams open and close on the
            # event loop, between the loop thread's gauge updates, which an idle stage makes only
            # every 0.5 s.
            metrics.in_flight.set_function(lambda: self.in_flight)
        self._exported = None  # the engine's exact_report as last exported (a start-up check replaces it)
        self._export_plan()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(Wake())
        self._thread.join(timeout=5)

    # Called from handlers (any thread).
    def add(self, request_id: str, payload: Any, sink: EventSink) -> None:
        self._commands.put(Add(request_id, payload, sink))

    def add_input(self, request_id: str, payload: Any) -> None:
        self._commands.put(Input(request_id, payload))

    def abort(self, request_id: str) -> None:
        self._commands.put(Abort(request_id))

    @property
    def in_flight(self) -> int:
        """Requests the engine holds, or streams open on the server, whichever is more (a stream
        outlives its engine request while it relays the next stage's output)."""
        return max(len(self._sinks), self.streams.open if self.streams is not None else 0)

    def load_report(self, stage: str, cache_capacity: int = 0, draining: bool = False,
                    limits: common_pb2.StageLimits | None = None, reset_peak: bool = False) -> common_pb2.LoadReport:
        """omni.v1.LoadReport of this stage, read by the router to balance (and, for `limits`, by
        the stage before it)."""
        return common_pb2.LoadReport(
            stage=stage, queue_depth=self.engine.queue_depth, running=self.engine.running,
            step_ms=self.stats.step_ms_ewma, cache_used=self.engine.running if cache_capacity else 0,
            cache_capacity=cache_capacity, draining=draining, in_flight=self.in_flight, limits=limits,
            in_flight_peak=self.streams.take_peak(reset_peak) if self.streams is not None else 0,
            streams_total=self.streams.opened if self.streams is not None else 0,
        )

    def _observe(self, elapsed_ms: float, batch: int) -> None:
        m = self.metrics
        if m is None:
            return
        m.step_seconds.observe(elapsed_ms / 1000)
        if batch:
            m.batch_size.observe(batch)
        if prefills := self.engine.step_prefills:
            m.prefills.observe(prefills)

    def _export_plan(self) -> None:
        """Exact mode's plan, on the metrics when it changed (a check beside serving ended)."""
        report = self.engine.exact_report
        if self.metrics is not None and report is not None and report is not self._exported:
            self.metrics.exact_kernels(report)
        self._exported = report

    def _set_gauges(self) -> None:
        # After commands and after each step's events: a request that finished or was aborted
        # leaves the gauges at once, not at the next step (which an idle stage never takes).
        m = self.metrics
        if m is None:
            return
        m.queue_depth.set(self.engine.queue_depth)
        m.running.set(self.engine.running)
        m.cache_used.set(self.engine.running)

    # The loop thread.
    def _apply(self, command: Command) -> None:
        match command:
            case Add(request_id, payload, sink):
                self._sinks[request_id] = sink
                self._guarded(request_id, self.engine.add, request_id, payload)
            case Input(request_id, payload):
                if request_id in self._sinks:
                    self._guarded(request_id, self.engine.add_input, request_id, payload)
            case Abort(request_id):
                if self._sinks.pop(request_id, None) is not None:
                    self.engine.abort(request_id)
            case Wake():
                pass

    def _guarded(self, request_id: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # one bad request must not stop the loop
            log.exception("%s: request %s failed", self.name, request_id)
            self._fail(request_id, exc)

    def _fail(self, request_id: str, exc: Exception) -> None:
        sink = self._sinks.pop(request_id, None)
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("%s: abort of %s failed", self.name, request_id)
        if sink is not None:
            sink.deliver(EngineFailed(self.name, f"{type(exc).__name__}: {exc}"))

    def _account(self, phase: str, seconds: float) -> None:
        if self.metrics is not None and seconds > 0:
            self.metrics.phase[phase].inc(seconds)

    def _idle_wait(self) -> float:
        """How long an idle loop blocks for a command: 0.5 s, or less when the engine wants a step
        by a time of its own (`wake_in`: the thinker's text holds end on their own)."""
        due = self.engine.wake_in()
        return 0.5 if due is None else min(0.5, due)

    def _run(self) -> None:
        timer = self.engine.timer  # a ForwardTimer (seconds in model forwards), or None
        cpu = time.thread_time()
        while not self._stopped.is_set():
            self._apply_commands()
            if self.metrics is not None:
                now_cpu = time.thread_time()
                self.metrics.engine_cpu.inc(max(now_cpu - cpu, 0.0))
                cpu = now_cpu
            self._set_gauges()
            self._adopt_checks()
            if self.engine.has_work():
                self._step(timer)

    def _adopt_checks(self) -> None:
        """A start-up check's verdict, adopted between steps (an idle loop comes by every 0.5 s)."""
        try:
            self.engine.adopt_checks()
        except Exception:  # a verdict that cannot be adopted leaves the plan in force, never the loop down
            log.exception("%s: adopting a start-up check's verdict failed; the plan in force stays", self.name)
        self._export_plan()

    def _apply_commands(self) -> None:
        """Every queued command; blocks for the first only when the engine has nothing to do."""
        waited = time.perf_counter()
        try:
            command = self._commands.get(timeout=self._idle_wait()) if not self.engine.has_work() \
                else self._commands.get_nowait()
        except queue.Empty:
            command = None
        applied = time.perf_counter()
        self._account("idle", applied - waited)
        if command is not None:
            self._apply(command)
            try:
                while True:
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            self._account("commands", time.perf_counter() - applied)

    def _step(self, timer) -> None:
        """One engine step, timed (model forwards apart), its events handed to their streams."""
        if timer is not None:
            timer.take()  # forwards outside a step (none today) are not this step's
        start, start_ns = time.perf_counter(), time.time_ns()
        try:
            events = self.engine.step()
        except Exception as exc:
            log.exception("%s: engine step failed; failing its running requests", self.name)
            for request_id in list(self._sinks):
                self._fail(request_id, exc)
            return
        elapsed_ms = (time.perf_counter() - start) * 1000
        forward = timer.take() if timer is not None else 0.0
        if timer is not None and self.metrics is not None:
            self.metrics.forward_seconds.observe(forward)
            self._account("forward", forward)
        self.stats.steps += 1
        self.stats.step_ms_ewma = elapsed_ms if self.stats.steps == 1 else 0.9 * self.stats.step_ms_ewma + 0.1 * elapsed_ms
        self._observe(elapsed_ms, len({request_id for request_id, _ in events}))
        for request_id, event in events:
            sink = self._sinks.get(request_id)
            if sink is None:
                continue
            if event.final:
                del self._sinks[request_id]
            if sink.first_step_ns is None:
                sink.first_step_ns = start_ns
            if isinstance(event, RequestFailed):
                event = InvalidArgument(event.field, event.message) if event.field else EngineFailed(self.name, event.message)
            sink.deliver(event)
        # The rest of the step and the hand-off of its events: scheduling, sampling, bookkeeping.
        self._account("engine", time.perf_counter() - start - forward)
        self._set_gauges()
