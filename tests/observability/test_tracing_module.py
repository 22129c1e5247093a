"""services/serving/tracing.py on its own: off by default, the flag and the OTEL_* variables turn it
on, a stage's RequestTrace hangs its phases under its server span with counts as attributes, and
JSON log lines carry the trace and request ids. The spans go to the SDK's in-memory exporter in a
child process (the global tracer provider is set once per process, so not in the test session).
And what the server span's end relies on: every stage handler, and every interceptor's wrapper
around one, closes what it relays when it is closed itself."""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import importlib
import json
import logging
import subprocess
import sys
import types

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from omni.v1 import stages_pb2
from services.serving import tracing
from services.serving.decode_guard import DecodeGuard
from services.serving.open_streams import OpenStreams
from services.serving.tracing import REQUEST_ID, JsonFormatter, RequestTrace, TracingConfig


def test_off_by_default_and_the_flag_or_the_otel_variables_turn_it_on(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED",
                 "OMNI_OTLP_ENDPOINT", "OMNI_LOG_FORMAT"):
        monkeypatch.delenv(name, raising=False)
    parser = argparse.ArgumentParser()
    tracing.add_tracing_flags(parser)
    config = tracing.tracing_from_args(parser.parse_args([]))
    assert config == TracingConfig() and config.endpoint == "" and config.log_format == "text"
    assert tracing.setup("router", config) is False
    assert tracing.server_interceptors() == ()
    opened = []  # off, a pipeline call is opened exactly as asked: no span, no metadata added
    tracing.call("/omni.v1.Talker/Speak", lambda *a, **k: opened.append((a, k)), 1, metadata=None, timeout=2)
    assert opened == [((1,), {"metadata": None, "timeout": 2})]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert TracingConfig().endpoint == "http://collector:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    assert TracingConfig().endpoint == "http://traces:4317"
    flagged = tracing.tracing_from_args(parser.parse_args(["--otlp-endpoint", "http://flag:4317", "--log-format", "json"]))
    assert flagged.endpoint == "http://flag:4317" and flagged.log_format == "json"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert flagged.endpoint == ""
    monkeypatch.setenv("OMNI_OTLP_ENDPOINT", "collector:4317")  # the ConfigMap's way (OMNI_<FLAG>), over OTEL_*
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    parser = argparse.ArgumentParser()
    tracing.add_tracing_flags(parser)  # (the defaults are read from the environment when the flags are made)
    assert tracing.tracing_from_args(parser.parse_args([])).endpoint == "collector:4317"


def test_a_request_trace_costs_nothing_without_a_recording_span():
    def handler():  # as in a gRPC handler's own task: the request id stays in its context
        spans = RequestTrace("talker", "req-1")
        assert not spans.on and REQUEST_ID.get() == "req-1"
        spans.phase("queue", 1, 2)
        spans.open("decode")
        spans.count("frames", 3)
        spans.close("decode")
        spans.finish("ok")
        assert spans.counts == {}

    contextvars.copy_context().run(handler)
    assert REQUEST_ID.get() == ""


CHILD = r"""
import json
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from services.serving.tracing import RequestTrace, now_ns

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
with trace.get_tracer("test").start_as_current_span("/omni.v1.Talker/Speak", kind=trace.SpanKind.SERVER):
    spans = RequestTrace("talker", "req-7", **{"omni.replay": False})
    added = now_ns()
    spans.phase("queue", added, added + 1000)
    spans.open("decode")
    for _ in range(40):
        spans.count("frames")
    spans.open("migrate", **{"omni.peer": "code2wav"})
    with spans.within("migrate"):
        trace.get_tracer("test").start_span("/omni.v1.Code2Wav/Decode", kind=trace.SpanKind.CLIENT).end()
    spans.close("migrate")
    spans.close("decode", frames=40)
    spans.finish("cancelled")
print(json.dumps([{"name": s.name, "id": s.context.span_id, "parent": s.parent.span_id if s.parent else None,
                   "attributes": dict(s.attributes), "events": [e.name for e in s.events],
                   "start": s.start_time, "end": s.end_time} for s in exporter.get_finished_spans()]))
"""


def test_a_stage_s_phases_hang_under_its_server_span_with_counts_not_a_span_per_step():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    spans = {s["name"]: s for s in json.loads(out.stdout)}
    assert set(spans) == {"/omni.v1.Talker/Speak", "queue", "decode", "migrate", "/omni.v1.Code2Wav/Decode"}
    server = spans["/omni.v1.Talker/Speak"]
    for name in ("queue", "decode", "migrate"):
        assert spans[name]["parent"] == server["id"], name
    assert spans["/omni.v1.Code2Wav/Decode"]["parent"] == spans["migrate"]["id"]  # the replay under `migrate`
    assert spans["queue"]["end"] - spans["queue"]["start"] == 1000
    assert spans["decode"]["attributes"] == {"frames": 40}
    assert server["attributes"]["omni.request_id"] == "req-7" and server["attributes"]["omni.stage"] == "talker"
    assert server["attributes"]["omni.frames"] == 40 and server["attributes"]["omni.outcome"] == "cancelled"
    assert server["events"] == ["cancelled"]


def test_json_log_lines_carry_the_trace_and_request_ids():
    record = logging.LogRecord("talker", logging.WARNING, __file__, 1, "moved %s", ("req-9",), None)
    context = SpanContext(trace_id=0x1234, span_id=0x99, is_remote=False, trace_flags=TraceFlags(1))
    token = REQUEST_ID.set("req-9")
    try:
        with trace.use_span(NonRecordingSpan(context)):
            line = json.loads(JsonFormatter("talker").format(record))
    finally:
        REQUEST_ID.reset(token)
    assert line["message"] == "moved req-9" and line["level"] == "WARNING" and line["service"] == "talker"
    assert line["trace_id"] == f"{0x1234:032x}" and line["span_id"] == f"{0x99:016x}" and line["request_id"] == "req-9"
    assert line["time"].endswith("Z")
    bare = json.loads(JsonFormatter("router").format(logging.LogRecord("router", logging.INFO, __file__, 1, "up", (), None)))
    assert "trace_id" not in bare and "request_id" not in bare


WIRE_CHILD = r"""
import asyncio, json
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from services.serving import tracing
from services.serving.grpc_server import build_server
from services.serving.tracing import REQUEST_ID, RequestTrace, now_ns

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
tracing._STATE.enabled = True  # (what `setup` does, with the in-memory exporter instead of OTLP)
seen = {}

async def speak(requests, context):
    metadata = dict(context.invocation_metadata())
    first = await anext(aiter(requests))
    request_id = first.decode()
    spans = RequestTrace("talker", request_id)
    seen[request_id] = {"traceparent": metadata.get("traceparent"), "current": spans.on,
                        "request_id": REQUEST_ID.get()}
    spans.phase("queue", now_ns() - 1000)
    outcome = "cancelled"
    try:
        yield b"started"
        async for message in requests:
            if message == b"end":
                outcome = "ok"
                yield b"final"
                return
            if message == b"flood":  # more than the caller reads: the handler waits at a yield
                while True:
                    yield bytes(1 << 20)
            spans.count("frames")
            yield message
    finally:
        spans.finish(outcome)

async def main():
    handle = build_server("127.0.0.1", 0, ("omni.v1.Talker",))
    handle.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "omni.v1.Talker", {"Speak": grpc.stream_stream_rpc_method_handler(speak)}),))
    await handle.server.start()
    await handle.set_serving(True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    method = channel.stream_stream("/omni.v1.Talker/Speak")
    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())  # not traced
    with trace.get_tracer("test").start_as_current_span("caller"):
        done = tracing.call("/omni.v1.Talker/Speak", method, metadata=(("authorization", "Bearer x"),))
        await done.write(b"req-ok")
        assert await done.read() == b"started"
        for i in range(3):
            await done.write(b"frame")
            assert await done.read() == b"frame"
        await done.write(b"end")
        assert await done.read() == b"final"
        done.cancel()  # as the stages end a stream once its final message is in
        gone = tracing.call("/omni.v1.Talker/Speak", method)
        await gone.write(b"req-gone")
        assert await gone.read() == b"started"
        await gone.write(b"frame")
        assert await gone.read() == b"frame"
        gone.cancel()  # the caller goes away while the handler waits for input
        held = tracing.call("/omni.v1.Talker/Speak", method)
        await held.write(b"req-held")
        assert await held.read() == b"started"
        await held.write(b"flood")
        await asyncio.sleep(0.5)  # (flow control stops the handler at a yield)
        held.cancel()
    for _ in range(200):
        if len(exporter.get_finished_spans()) >= 10:
            break
        await asyncio.sleep(0.02)
    await channel.close()
    await handle.server.stop(0)

asyncio.run(main())
print(json.dumps({"seen": seen, "spans": [
    {"name": s.name, "kind": s.kind.name, "id": s.context.span_id, "trace": s.context.trace_id,
     "parent": s.parent.span_id if s.parent else None, "attributes": dict(s.attributes),
     "events": [e.name for e in s.events], "status": s.status.status_code.name}
    for s in exporter.get_finished_spans()]}))
"""


def test_a_pipeline_call_carries_its_trace_in_metadata_and_the_server_span_is_opened_once_per_call():
    """Real gRPC on loopback, tracing on: `tracing.call` opens the CLIENT span and sends its context
    as `traceparent`; the server's interceptor opens the SERVER span from it, current in the handler,
    and ends it after the handler's `finally` (outcome, counts), for a cancelled call too."""
    out = subprocess.run([sys.executable, "-c", WIRE_CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    spans = result["spans"]
    assert sorted((s["name"], s["kind"]) for s in spans) == sorted(
        [("caller", "INTERNAL")] + [("/omni.v1.Talker/Speak", "CLIENT"), ("/omni.v1.Talker/Speak", "SERVER"),
                                    ("queue", "INTERNAL")] * 3), "one client and one server span per call, no health"
    (caller,) = [s for s in spans if s["name"] == "caller"]
    assert {s["trace"] for s in spans} == {caller["trace"]}
    by_id = {s["id"]: s for s in spans}
    # (status codes: the handler of req-ok set its outcome before it yielded the final message, and its
    # caller cancels once it has it, which may reach the handler at that yield, before it returns, as a
    # loaded make test saw: CANCELLED on the server too, the outcome still ok; the client sees either;
    # a cancel reaches req-gone's handler as the end of its input first, where it may end before grpc
    # cancels it)
    for request_id, outcome, codes, client_codes in (("req-ok", "ok", {0, 1}, {0, 1}),
                                                     ("req-gone", "cancelled", {0, 1}, {1}),
                                                     ("req-held", "cancelled", {1}, {1})):
        (server,) = [s for s in spans if s["kind"] == "SERVER" and s["attributes"]["omni.request_id"] == request_id]
        client = by_id[server["parent"]]
        assert client["kind"] == "CLIENT" and client["parent"] == caller["id"]
        seen = result["seen"][request_id]
        assert seen["traceparent"].startswith(f"00-{caller['trace']:032x}-{client['id']:016x}-"), seen  # (flags: sampled)
        assert seen["current"] and seen["request_id"] == request_id
        assert server["attributes"]["omni.outcome"] == outcome, server["attributes"]
        assert server["attributes"]["rpc.grpc.status_code"] in codes and server["status"] == "UNSET"
        assert server["attributes"]["rpc.service"] == "omni.v1.Talker" and server["attributes"]["rpc.method"] == "Speak"
        assert client["attributes"]["rpc.grpc.status_code"] in client_codes and client["status"] == "UNSET"
        (queue,) = [s for s in spans if s["name"] == "queue" and s["parent"] == server["id"]]
    ok = next(s for s in spans if s["kind"] == "SERVER" and s["attributes"]["omni.request_id"] == "req-ok")
    assert ok["attributes"]["omni.frames"] == 3
    for request_id in ("req-gone", "req-held"):  # req-held's handler was closed at its yield, before the span ended
        gone = next(s for s in spans if s["kind"] == "SERVER" and s["attributes"]["omni.request_id"] == request_id)
        assert gone["events"] == ["cancelled"]


class _Relayed:
    """Stands in for a stage's stream object (RouterStream, ThinkerStream, TalkerStream, Code2WavStream): its
    `run` yields two messages and records when its `finally` runs."""

    closed: list[str] = []

    def __init__(self, *args):
        pass

    async def run(self, *args):
        try:
            yield "first"
            yield "second"
        finally:
            _Relayed.closed.append("closed")


def _code2wav_inputs():
    async def inputs():
        yield stages_pb2.Code2WavInput(start=stages_pb2.Code2WavStart(request_id="r"))
    return inputs()


@pytest.mark.parametrize("module, servicer, method, stream, args", [
    ("router.server", "OmniServicer", "Generate", "RouterStream", lambda: (None, None)),
    ("services.thinker.server", "ThinkerServicer", "Generate", "ThinkerStream", lambda: (None, None)),
    ("services.talker.server", "TalkerServicer", "Speak", "TalkerStream", lambda: (None, None)),
    ("services.code2wav.server", "Code2WavServicer", "Decode", "Code2WavStream", lambda: (_code2wav_inputs(), None)),
], ids=["router", "thinker", "talker", "code2wav"])
def test_each_stage_handler_closed_at_a_yield_closes_its_stream_at_once(monkeypatch, module, servicer, method, stream,
                                                                        args):
    """grpc closes a cancelled call's handler at its `yield`; the stream it relays must close then
    too, not later when it is collected: its `finally` writes the trace's outcome, and the server
    span ends right after the handler closes (a code2wav handler without it lost the outcome when
    the talker cancelled the call as the final message went out)."""
    served = importlib.import_module(module)
    monkeypatch.setattr(served, stream, _Relayed)
    monkeypatch.setattr(_Relayed, "closed", [])

    async def scenario():
        handler = getattr(getattr(served, servicer), method)(None, *args())
        assert await anext(handler) == "first"
        await handler.aclose()
        return list(_Relayed.closed)

    assert asyncio.run(scenario()) == ["closed"]


def test_the_interceptors_wrappers_closed_at_a_yield_close_the_handler_they_wrap_at_once():
    """The same for the interceptors around every stage handler (the body check and the open-streams
    count): each wraps the handler in a generator of its own when tracing is off, and closes it
    with itself; the open count is back at 0 then too."""
    closed = []

    async def handler(request, context):
        try:
            yield "first"
            yield "second"
        finally:
            closed.append(request)

    method = "/omni.v1.Code2Wav/Decode"
    details = types.SimpleNamespace(method=method, invocation_metadata=())  # (grpc.HandlerCallDetails: a protocol)
    counted = OpenStreams(("omni.v1.Code2Wav",))

    async def scenario():
        async def the_handler(_details):
            return grpc.unary_stream_rpc_method_handler(handler, request_deserializer=stages_pb2.Code2WavStart.FromString)

        async def counted_handler(_details):  # (the server's order: DecodeGuard, then OpenStreams)
            return await counted.intercept_service(the_handler, details)

        guarded = await DecodeGuard().intercept_service(counted_handler, details)
        stream = guarded.unary_stream(stages_pb2.Code2WavStart(request_id="r").SerializeToString(), None)
        assert await anext(stream) == "first" and counted.open == 1
        await stream.aclose()
        return list(closed), counted.open

    assert asyncio.run(scenario()) == ([stages_pb2.Code2WavStart(request_id="r")], 0)
