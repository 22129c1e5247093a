"""The engine loop (services/serving/engine_loop.py): commands in from any thread, events out to
each stream's sink in order, failures raised at the stream, nothing kept after a request ends.
A scripted engine stands in for the model: the loop's contract, not the model, is under test."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from services.base.engine import EngineDefaults
from services.base.events import EngineEvent, RequestFailed
from services.base.timing import ForwardTimer
from services.serving.engine_loop import EngineLoop, EventSink
from services.serving.status import EngineFailed, StreamIdle


@dataclass(frozen=True)
class Piece(EngineEvent):
    n: int


@dataclass(frozen=True)
class Done(EngineEvent):
    total: int
    final: ClassVar[bool] = True


@dataclass
class CountingEngine(EngineDefaults):
    """Each request asks for `payload` pieces; one step emits one piece per running request, then
    Done. Inputs add to a request's count; a payload of -1 makes `add` raise, -2 makes the
    request fail inside a step, -3 makes the step itself raise. A request named in `waiting`
    does not end when its count runs out: it waits (no work, nothing emitted) for an input, as a
    talker request waits for its next text row."""

    todo: dict[str, int] = field(default_factory=dict)  # request_id -> pieces left
    made: dict[str, int] = field(default_factory=dict)  # request_id -> pieces emitted
    aborted: list[str] = field(default_factory=list)
    waiting: set[str] = field(default_factory=set)  # requests that wait for an input once their count is 0

    def add(self, request_id: str, payload: int) -> None:
        if payload == -1:
            raise ValueError("bad job")
        self.todo[request_id], self.made[request_id] = payload, 0

    def add_input(self, request_id: str, payload: int) -> None:
        self.todo[request_id] += payload
        self.waiting.discard(request_id)

    def _ready(self, request_id: str) -> bool:
        return not (request_id in self.waiting and self.todo[request_id] == 0)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.todo.pop(request_id, None)

    def has_work(self) -> bool:
        return any(self._ready(request_id) for request_id in self.todo)

    @property
    def queue_depth(self) -> int:
        return 0

    @property
    def running(self) -> int:
        return len(self.todo)

    def step(self) -> list[tuple[str, EngineEvent]]:
        events = []
        for request_id in list(self.todo):
            if not self._ready(request_id):
                continue
            if self.todo[request_id] == -3:
                raise RuntimeError("kernel fault")
            if self.todo[request_id] == -2:
                del self.todo[request_id]
                events.append((request_id, RequestFailed("the backend dropped it")))
            elif self.todo[request_id] == 0:
                del self.todo[request_id]
                events.append((request_id, Done(self.made[request_id])))
            else:
                self.todo[request_id] -= 1
                self.made[request_id] += 1
                events.append((request_id, Piece(self.made[request_id])))
        return events


def run(body, waiting: frozenset[str] = frozenset()):
    """Run `body(loop, engine)` (a coroutine function) against a started EngineLoop; `waiting`:
    requests that wait for an input when their count runs out (CountingEngine.waiting)."""
    engine = CountingEngine(waiting=set(waiting))
    loop = EngineLoop(engine, "test")
    loop.start()
    try:
        return asyncio.run(body(loop, engine))
    finally:
        loop.stop()


async def drain(sink: EventSink) -> list:
    events = []
    while not events or not events[-1].final:
        events.append(await sink.get(5.0))
    return events


def test_events_arrive_in_order_and_the_final_one_frees_the_request():
    async def body(loop, engine):
        sinks = {rid: EventSink(asyncio.get_running_loop()) for rid in ("a", "b")}
        loop.add("a", 3, sinks["a"])
        loop.add("b", 1, sinks["b"])
        events = {rid: await drain(sink) for rid, sink in sinks.items()}
        return events, loop.in_flight

    events, in_flight = run(body)
    assert events["a"] == [Piece(1), Piece(2), Piece(3), Done(3)]
    assert events["b"] == [Piece(1), Done(1)]
    assert in_flight == 0


def test_inputs_reach_a_running_request():
    # "a" makes its one piece, then waits: only the input's 2 more pieces can end it, with Done(3).
    # An input lost on the way leaves it waiting (sink.get times out); one applied twice gives 5.
    async def body(loop, engine):
        sink = EventSink(asyncio.get_running_loop())
        loop.add("a", 1, sink)
        first = await sink.get(5.0)
        assert loop.in_flight == 1 and not engine.has_work()
        loop.add_input("a", 2)
        return [first] + await drain(sink)

    events = run(body, waiting=frozenset({"a"}))
    assert events == [Piece(1), Piece(2), Piece(3), Done(3)]


def test_a_failing_add_fails_only_that_stream():
    async def body(loop, engine):
        bad, good = EventSink(asyncio.get_running_loop()), EventSink(asyncio.get_running_loop())
        loop.add("bad", -1, bad)
        loop.add("good", 2, good)
        with pytest.raises(EngineFailed, match="test: ValueError: bad job"):
            await bad.get(5.0)
        return await drain(good), loop.in_flight

    events, in_flight = run(body)
    assert events == [Piece(1), Piece(2), Done(2)] and in_flight == 0


def test_a_request_the_engine_fails_ends_its_stream_with_engine_failed():
    async def body(loop, engine):
        sink = EventSink(asyncio.get_running_loop())
        loop.add("a", -2, sink)
        with pytest.raises(EngineFailed, match="the backend dropped it"):
            await sink.get(5.0)
        return loop.in_flight

    assert run(body) == 0


def test_a_step_that_raises_fails_every_running_request_and_the_loop_goes_on():
    async def body(loop, engine):
        doomed = EventSink(asyncio.get_running_loop())
        loop.add("doomed", -3, doomed)
        with pytest.raises(EngineFailed, match="RuntimeError: kernel fault"):
            await doomed.get(5.0)
        after = EventSink(asyncio.get_running_loop())
        loop.add("after", 1, after)
        return await drain(after), engine.aborted

    events, aborted = run(body)
    assert events == [Piece(1), Done(1)] and "doomed" in aborted


def test_abort_reaches_the_engine_and_the_stream_gets_nothing_more():
    async def body(loop, engine):
        sink = EventSink(asyncio.get_running_loop())
        loop.add("a", 10_000, sink)
        await sink.get(5.0)
        loop.abort("a")
        for _ in range(200):  # the loop thread applies the abort between steps
            if not loop.in_flight and "a" in engine.aborted:
                break
            await asyncio.sleep(0.01)
        return loop.in_flight, engine.aborted, engine.has_work()

    in_flight, aborted, busy = run(body)
    assert in_flight == 0 and aborted == ["a"] and not busy


def test_a_silent_stream_ends_with_stream_idle_naming_the_stage():
    async def body(loop, engine):
        sink = EventSink(asyncio.get_running_loop())
        with pytest.raises(StreamIdle, match="talker: no progress on this stream for 0.05 s"):
            await sink.get(0.05, "talker")

    run(body)


def test_load_report_counts_streams_and_carries_limits():
    from omni.v1 import common_pb2

    async def body(loop, engine):
        sink = EventSink(asyncio.get_running_loop())
        loop.add("a", 10_000, sink)
        await sink.get(5.0)
        limits = common_pb2.StageLimits(max_model_len=64, max_new_tokens_limit=32, default_max_new_tokens=16)
        report = loop.load_report("talker", cache_capacity=4, draining=True, limits=limits)
        loop.abort("a")
        return report

    report = run(body)
    assert (report.stage, report.in_flight, report.running, report.cache_capacity, report.draining) == (
        "talker", 1, 1, 4, True)
    assert report.limits.max_model_len == 64 and report.limits.max_new_tokens_limit == 32


@dataclass
class TimedEngine(CountingEngine):
    """A CountingEngine whose steps spend ~5 ms in a "forward" (a ForwardTimer block) and ~2 ms around it."""

    timer: ForwardTimer | None = None

    def step(self):
        import time

        with self.timer:
            time.sleep(0.005)
        time.sleep(0.002)
        return super().step()


def test_the_loop_accounts_step_time_to_forward_and_engine():
    from services.serving.metrics import StageMetrics

    metrics = StageMetrics("test")
    engine = TimedEngine(timer=ForwardTimer())
    loop = EngineLoop(engine, "test", metrics)
    loop.start()

    async def body():
        sink = EventSink(asyncio.get_running_loop())
        loop.add("a", 4, sink)
        return await drain(sink)

    try:
        asyncio.run(body())
    finally:
        loop.stop()
    value = lambda name, **labels: metrics.registry.get_sample_value(name, {"stage": "test", **labels})  # noqa: E731
    steps = value("omni_stage_step_seconds_count")
    assert steps == 5  # 4 pieces and Done
    forward = value("omni_stage_loop_seconds_total", phase="forward")
    engine_s = value("omni_stage_loop_seconds_total", phase="engine")
    assert forward >= 5 * 0.005 and engine_s >= 5 * 0.002  # sleeps: at least, never less
    assert value("omni_stage_forward_seconds_count") == steps
    assert value("omni_stage_loop_seconds_total", phase="idle") > 0
    assert value("omni_stage_engine_thread_cpu_seconds_total") >= 0
    assert value("omni_stage_process_cpu_seconds") > 0


def test_wire_encoding_time_is_counted():
    import torch

    from services.serving.metrics import WIRE_TIME
    from services.serving.wire import tensor_from_proto, tensor_to_proto

    before = WIRE_TIME.seconds
    assert torch.equal(tensor_from_proto(tensor_to_proto(torch.arange(6.0).view(2, 3))), torch.arange(6.0).view(2, 3))
    assert WIRE_TIME.seconds > before
