"""One engine loop per service, off the gRPC event loop.

gRPC handlers (asyncio) only convert and enqueue commands; a dedicated thread drains the
command queue, steps the model, and hands each event back to the handler's asyncio queue with
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
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What a stage engine offers the loop. All calls happen on the loop thread."""

    def add(self, request_id: str, payload: Any) -> None: ...
    def add_input(self, request_id: str, payload: Any) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[tuple[str, Any]]: ...  # (request_id, event) pairs


@dataclass(frozen=True)
class EngineFailed:
    """Delivered to a request's stream when the engine raised while serving it."""

    message: str


def engine_key(request_id: str) -> str:
    """The engine's key for one stream: the caller's request id made unique."""
    return f"{request_id}#{uuid.uuid4().hex[:12]}"


class StreamIdle(Exception):
    """A stream saw no event for its idle timeout (a stalled or vanished peer)."""


class EventSink:
    """An asyncio queue that the engine thread can put into."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put_threadsafe(self, event: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop closed: the caller is gone
            pass

    async def get(self, idle_timeout_s: float | None = None, stage: str = "stage") -> Any:
        """The next event; no stage waits forever: silence past the idle timeout is an error."""
        try:
            return await asyncio.wait_for(self.queue.get(), idle_timeout_s)
        except TimeoutError:
            raise StreamIdle(f"{stage}: no progress on this stream for {idle_timeout_s:g} s") from None


@dataclass
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

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout=5)

    # Called from handlers (any thread).
    def add(self, request_id: str, payload: Any, sink: EventSink) -> None:
        self._commands.put(("add", request_id, (payload, sink)))

    def add_input(self, request_id: str, payload: Any) -> None:
        self._commands.put(("input", request_id, payload))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

    def load_report(self, stage: str, cache_capacity: int = 0, draining: bool = False):
        """omni.v1.LoadReport of this stage, read by the router to balance."""
        from omni.v1 import common_pb2

        return common_pb2.LoadReport(
            stage=stage, queue_depth=self.engine.queue_depth, running=self.engine.running,
            step_ms=self.stats.step_ms_ewma, cache_used=self.engine.running if cache_capacity else 0,
            cache_capacity=cache_capacity, draining=draining, in_flight=self.in_flight,
        )

    def _observe(self, elapsed_ms: float, batch: int) -> None:
        m = self.metrics
        if m is None:
            return
        m.step_seconds.observe(elapsed_ms / 1000)
        if batch:
            m.batch_size.observe(batch)
        m.queue_depth.set(self.engine.queue_depth)
        m.running.set(self.engine.running)
        m.cache_used.set(self.engine.running)
        m.in_flight.set(len(self._sinks))

    # The loop thread.
    def _apply(self, command: tuple) -> None:
        kind, request_id, payload = command
        if kind == "add":
            request, sink = payload
            self._sinks[request_id] = sink
            self._guarded(request_id, self.engine.add, request_id, request)
        elif kind == "input":
            if request_id in self._sinks:
                self._guarded(request_id, self.engine.add_input, request_id, payload)
        elif kind == "abort":
            if self._sinks.pop(request_id, None) is not None:
                self.engine.abort(request_id)

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
            sink.put_threadsafe(EngineFailed(f"{type(exc).__name__}: {exc}"))

    def _run(self) -> None:
        while not self._stopped.is_set():
            # Block for a command only when the engine has nothing to do.
            try:
                command = self._commands.get(timeout=0.5) if not self.engine.has_work() else self._commands.get_nowait()
                self._apply(command)
                while True:
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_work():
                continue
            start = time.perf_counter()
            try:
                events = self.engine.step()
            except Exception as exc:
                log.exception("%s: engine step failed; failing its running requests", self.name)
                for request_id in list(self._sinks):
                    self._fail(request_id, exc)
                continue
            elapsed_ms = (time.perf_counter() - start) * 1000
            self.stats.steps += 1
            self.stats.step_ms_ewma = elapsed_ms if self.stats.steps == 1 else 0.9 * self.stats.step_ms_ewma + 0.1 * elapsed_ms
            self._observe(elapsed_ms, len({request_id for request_id, _ in events}))
            for request_id, event in events:
                sink = self._sinks.get(request_id)
                if sink is None:
                    continue
                if getattr(event, "final", False):
                    del self._sinks[request_id]
                sink.put_threadsafe(event)
