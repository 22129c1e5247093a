"""services/serving/tracing.py on its own: off by default, the flag and the OTEL_* variables turn it
on, a stage's RequestTrace hangs its phases under its server span with counts as attributes, and
JSON log lines carry the trace and request ids. The spans go to the SDK's in-memory exporter in a
child process (the global tracer provider is set once per process, so not in the test session)."""

from __future__ import annotations

import argparse
import contextvars
import json
import logging
import subprocess
import sys

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from services.serving import tracing
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
    assert tracing.server_interceptors() == () and tracing.client_interceptors() is None
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
