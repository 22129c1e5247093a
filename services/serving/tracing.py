"""Tracing and structured logs: one request's spans across gateway, router, thinker, talker and
code2wav (OpenTelemetry, exported over OTLP/gRPC), and log lines that carry its trace and request id.

Off by default. `--otlp-endpoint URL` (or OMNI_OTLP_ENDPOINT, or the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT) turns it on; the other standard
OTEL_* variables keep their meaning (OTEL_TRACES_SAMPLER, OTEL_BSP_SCHEDULE_DELAY,
OTEL_RESOURCE_ATTRIBUTES, OTEL_SDK_DISABLED=true turns it off again). Every process calls `setup`
once at start, before it builds its server or channels; the rest of the code only ever calls
`server_interceptors`, `client_interceptors` and `RequestTrace`, which cost nothing when off.

W3C trace context (`traceparent`) travels in gRPC metadata: the gRPC instrumentation's
interceptors put it on every pipeline call (Generate, Speak, Decode; not the health and load
polls) and start each server span from it, so the stages' spans share the caller's trace, across
migrations too (a replay's call is opened under the `migrate` span of the stage that moved it).
The HTTP gateway's server span, continuing the HTTP caller's `traceparent` header, is FastAPI's
own (its built-in telemetry starts once a tracer provider is set).

What a stage adds to its server span (RequestTrace): the request id and replica as attributes,
finished child spans for the phases a request spends there (`admission`, `prepare`, `queue`,
`prefill`, `first_chunk`, `decode`, `migrate`), events for first output and cancellation, and
counts (tokens, frames, chunks) as attributes at the end: never a span per token or step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import logging
import os
import socket
import time
from dataclasses import dataclass

from opentelemetry import trace

from services.runtime.settings import env_default

# The request a log line is about (set by RequestTrace in the handler's task; empty elsewhere).
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("omni_request_id", default="")

# The calls that carry one request through the pipeline; health checks and load polls (several a
# second per replica) are not traced.
PIPELINE_METHODS = ("Generate", "Speak", "Decode")
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class TracingConfig:
    otlp_endpoint: str = ""  # where spans go (OTLP/gRPC, e.g. http://otel-collector:4317); empty: the OTEL_* env
    log_format: str = "text"  # or "json": one object a line, with trace_id, span_id and request_id

    @property
    def endpoint(self) -> str:
        """The OTLP endpoint in force: the flag, else the standard variables; empty = tracing off."""
        if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return ""
        return (self.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""))


def add_tracing_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otlp-endpoint", default=env_default("otlp_endpoint", ""), metavar="URL",
                        help="export OpenTelemetry traces over OTLP/gRPC to URL (http://host:4317 plaintext, "
                             "https:// TLS); default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else off")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=env_default("log_format", "text"),
                        help="text (default) or json: one JSON object a line with trace_id, span_id, request_id")


def tracing_from_args(args: argparse.Namespace) -> TracingConfig:
    return TracingConfig(otlp_endpoint=args.otlp_endpoint, log_format=args.log_format)


class _State:
    enabled = False
    replica = ""  # this process: host:port (or host, pid), the `omni.replica` of its spans


_STATE = _State()


def setup(service: str, config: TracingConfig, port: int = 0) -> bool:
    """Install the tracer provider and OTLP exporter for process `service` (router, thinker, ...)
    when an endpoint is configured; True when tracing is on. Call once, before any server or
    channel is built (their interceptors are chosen then)."""
    _STATE.replica = f"{socket.gethostname()}:{port}" if port else f"{socket.gethostname()}/pid{os.getpid()}"
    endpoint = config.endpoint
    if not endpoint:
        return False
    # NOTE: imported here, so a process with tracing off never loads the SDK or the exporter.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"  # a bare host:port means a plaintext collector (the usual sidecar)
    resource = Resource.create({"service.name": f"omni-{service}", "service.instance.id": _STATE.replica})
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER (default: parent, else all)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)  # shut down (and flushed) at exit
    _STATE.enabled = True
    logging.getLogger(__name__).info("tracing on: OTLP/gRPC to %s as omni-%s (%s)", endpoint, service, _STATE.replica)
    return True


def _pipeline_filter():
    from opentelemetry.instrumentation.grpc import filters

    return filters.all_of(filters.service_prefix("omni.v1."),
                          filters.any_of(*(filters.method_name(m) for m in PIPELINE_METHODS)))


def server_interceptors() -> tuple:
    """The gRPC server interceptors of tracing (none when off): a server span per pipeline call,
    continuing the caller's trace from its `traceparent`."""
    if not _STATE.enabled:
        return ()
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return (_closing(aio_server_interceptor(filter_=_pipeline_filter())),)


def _closing(interceptor):
    """The instrumentation's server interceptor, except that a streaming handler is closed before
    its span ends. NOTE: its wrapper only iterates the handler, so a call cancelled while the handler
    waited at a `yield` ended the span at once and the handler's own `finally` (RequestTrace.finish:
    outcome, counts) ran later, when the handler was collected, on an ended span."""
    from opentelemetry.instrumentation.grpc import _aio_server

    class Closing(_aio_server.OpenTelemetryAioServerInterceptor):
        def _intercept_aio_server_stream(self, behavior, handler_call_details):
            async def stream(request_or_iterator, context):
                with self._set_remote_context(context):
                    with self._start_span(handler_call_details, context, set_status_on_exception=False) as span:
                        context = _aio_server._OpenTelemetryAioServicerContext(context, span)
                        responses = behavior(request_or_iterator, context)
                        try:
                            async for response in responses:
                                yield response
                        except Exception as error:
                            if type(error) is not Exception:  # (as the instrumentation: a bare one is an abort)
                                span.record_exception(error)
                            raise
                        finally:
                            close = getattr(responses, "aclose", None)  # (an async generator: every handler here)
                            if close is not None:
                                await close()

            return stream

    return Closing(interceptor._tracer, filter_=interceptor._filter)


def client_interceptors() -> list | None:
    """The grpc.aio client interceptors of tracing (None when off): a client span per pipeline call,
    its context sent on as `traceparent`."""
    if not _STATE.enabled:
        return None
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return [_streaming(i) for i in aio_client_interceptors(filter_=_pipeline_filter())]


_ENDING: set = set()  # the tasks that end streaming calls' client spans (a reference until they ran)


def _streaming(interceptor):
    """The instrumentation's interceptor, except that a streaming call's client span ends when the
    call does. NOTE: its own ends the span when the response iterator is exhausted, and the stages
    stop reading at the `final` message and cancel the call (services/serving/streams.py), so the
    span never ended: not one talker or code2wav client span reached the collector."""
    import grpc
    from opentelemetry.instrumentation.grpc import _aio_client

    def ending(span, call):
        async def end() -> None:
            code, details = await call.code(), await call.details()
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):  # a stream's end is a cancel
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code.name}: {details}"))
            span.end()

        def done(_call) -> None:
            task = asyncio.ensure_future(end())
            _ENDING.add(task)
            task.add_done_callback(_ENDING.discard)

        call.add_done_callback(done)
        return call

    class UnaryStream(_aio_client.UnaryStreamAioClientInterceptor):
        async def intercept_unary_stream(self, continuation, client_call_details, request):
            if self.tracing_skipped(client_call_details):
                return await continuation(client_call_details, request)
            with self._start_interceptor_span(client_call_details.method) as span:
                return ending(span, await continuation(self.propagate_trace_in_details(client_call_details), request))

    class StreamStream(_aio_client.StreamStreamAioClientInterceptor):
        async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
            if self.tracing_skipped(client_call_details):
                return await continuation(client_call_details, request_iterator)
            with self._start_interceptor_span(client_call_details.method) as span:
                return ending(span, await continuation(self.propagate_trace_in_details(client_call_details),
                                                       request_iterator))

    for base, replacement in ((_aio_client.UnaryStreamAioClientInterceptor, UnaryStream),
                              (_aio_client.StreamStreamAioClientInterceptor, StreamStream)):
        if type(interceptor) is base:
            return replacement(interceptor._tracer, filter_=interceptor._filter)
    return interceptor


def now_ns() -> int:
    """Wall-clock time as spans take it (nanoseconds since the epoch)."""
    return time.time_ns()


_TRACER = trace.get_tracer("omni-serve")


class RequestTrace:
    """One request in one process: its server span (the current span when made), the phase spans
    under it, events and counts. Every method is a no-op when tracing is off or the request is not
    sampled; it also binds the request id for log lines (REQUEST_ID)."""

    def __init__(self, stage: str, request_id: str, **attributes):
        REQUEST_ID.set(request_id)
        self.span = trace.get_current_span()
        self.on = self.span.is_recording()
        self.counts: dict[str, int] = {}  # attribute name -> count, written at `finish`
        self._open: dict[str, trace.Span] = {}  # phase name -> its span, until `close`
        self._seen: set[str] = set()  # what `first` was asked about
        if self.on:
            self.span.set_attributes({"omni.stage": stage, "omni.request_id": request_id,
                                      "omni.replica": _STATE.replica, **attributes})

    def first(self, what: str) -> bool:
        """True the first time it is asked about `what` (never when tracing is off)."""
        if not self.on or what in self._seen:
            return False
        self._seen.add(what)
        return True

    def set(self, **attributes) -> None:
        if self.on:
            self.span.set_attributes(attributes)

    def phase(self, name: str, start_ns: int | None, end_ns: int | None = None, **attributes) -> None:
        """A finished child span `name` from `start_ns` to `end_ns` (default now); skipped when
        `start_ns` is unknown."""
        if not self.on or start_ns is None:
            return
        context = trace.set_span_in_context(self.span)
        span = _TRACER.start_span(name, context=context, start_time=start_ns, attributes=attributes or None)
        span.end(end_time=end_ns if end_ns is not None else now_ns())

    def open(self, name: str, start_ns: int | None = None, **attributes) -> None:
        """A child span `name` that stays open until `close(name)` (a second `open` of it is ignored)."""
        if not self.on or name in self._open:
            return
        self._open[name] = _TRACER.start_span(name, context=trace.set_span_in_context(self.span),
                                              start_time=start_ns, attributes=attributes or None)

    def within(self, name: str):
        """A context manager: what starts inside (a call, a span) is a child of open phase `name`
        (of the server span when it is not open)."""
        span = self._open.get(name) if self.on else None
        return trace.use_span(span, end_on_exit=False) if span is not None else contextlib.nullcontext()

    def close(self, name: str, **attributes) -> None:
        span = self._open.pop(name, None) if self.on else None
        if span is not None:
            span.set_attributes(attributes)
            span.end()

    def event(self, name: str, **attributes) -> None:
        if self.on:
            self.span.add_event(name, attributes)

    def count(self, name: str, n: int = 1) -> None:
        if self.on:
            self.counts[name] = self.counts.get(name, 0) + n

    def finish(self, outcome: str) -> None:
        """At the end of the handler: counts, outcome (ok, cancelled, error...), open phases closed."""
        if not self.on:
            return
        if outcome == "cancelled":
            self.span.add_event("cancelled")
        for name in list(self._open):
            self.close(name, **{"omni.outcome": outcome})
        self.span.set_attributes({**{f"omni.{k}": v for k, v in self.counts.items()}, "omni.outcome": outcome})


class Migration:
    """The `migrate` span of a stream that moved to another replica (services/serving/migration.py):
    open from the failure to the first output of the new replica; the replay's call is opened
    under it, so the new replica's spans hang below it in the trace."""

    def __init__(self, owner: str, stage: str, left: str, to: str, move: int, reason: str):
        self.span = _TRACER.start_span("migrate", attributes={
            "omni.stage": owner, "omni.peer": stage, "omni.from_replica": left, "omni.to_replica": to,
            "omni.move": move, "omni.reason": reason, "omni.request_id": REQUEST_ID.get()})

    def current(self):
        """A context manager: calls opened inside are children of this span."""
        return trace.use_span(self.span, end_on_exit=False)

    def end(self, outcome: str = "moved") -> None:
        self.span.set_attribute("omni.outcome", outcome)
        self.span.end()


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, service, level, logger, message, and the trace_id, span_id and
    request_id of the request the line is about (when there is one)."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line = {"time": stamp, "service": self.service, "level": record.levelname, "logger": record.name,
                "message": record.getMessage()}
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            line["trace_id"] = format(context.trace_id, "032x")
            line["span_id"] = format(context.span_id, "016x")
        request_id = REQUEST_ID.get()
        if request_id:
            line["request_id"] = request_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def log_formatter(service: str, log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(service)
    return logging.Formatter(f"%(asctime)s {service} %(levelname)s %(message)s")
