"""A local OTLP/gRPC trace collector that keeps what it receives in memory: the tests' and the
bench's collector for `--otlp-endpoint` (the real services export to it exactly as they would to an
OpenTelemetry Collector). Not for production: it never forgets a span.

    with OtlpSink() as sink:   # listens on 127.0.0.1, any free port
        ... start processes with --otlp-endpoint sink.endpoint ...
        spans = sink.wait_for(lambda spans: len(spans) >= 10, timeout_s=30)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class SpanRecord:
    """One received span, flattened: ids as hex, attributes as Python values."""

    service: str  # resource service.name (omni-router, omni-thinker, ...)
    instance: str  # resource service.instance.id (host:port of the process)
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict  # key -> str | int | float | bool
    events: tuple[str, ...]  # event names, in order
    status_code: int  # 0 unset, 1 ok, 2 error


def _value(v: common_pb2.AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpSink):
        self.sink = sink

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context):
        records = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    records.append(SpanRecord(
                        service=str(resource.get("service.name", "")), instance=str(resource.get("service.instance.id", "")),
                        name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), kind=span.kind, start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano, attributes=_attributes(span.attributes),
                        events=tuple(e.name for e in span.events), status_code=span.status.code))
        self.sink.add(records)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpSink:
    """A grpc server with opentelemetry.proto's TraceService on loopback; a context manager."""

    def __init__(self, host: str = "127.0.0.1"):
        self._spans: list[SpanRecord] = []
        self._lock = threading.Condition()
        self.exports = 0  # Export calls received
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                   options=[("grpc.max_receive_message_length", 64 << 20)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port(f"{host}:0")
        self.endpoint = f"http://{host}:{self.port}"

    def __enter__(self) -> OtlpSink:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(0)

    def add(self, records: list[SpanRecord]) -> None:
        with self._lock:
            self._spans.extend(records)
            self.exports += 1
            self._lock.notify_all()

    def spans(self) -> list[SpanRecord]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(self, done: Callable[[list[SpanRecord]], bool], timeout_s: float) -> list[SpanRecord]:
        """The spans once `done(spans)` holds; AssertionError after `timeout_s` (with what came)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not done(self._spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"the collector did not get the spans in {timeout_s:g} s; "
                                         f"it has {len(self._spans)}: {sorted({(s.service, s.name) for s in self._spans})}")
                self._lock.wait(min(left, 0.5))
            return list(self._spans)
