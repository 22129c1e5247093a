"""Tracing and structured logs: one request's spans across gateway, router, thinker, talker and
code2wav (OpenTelemetry, exported over OTLP/gRPC), and log lines that carry its trace and request id.

Off by default. `--otlp-endpoint URL` (or OMNI_OTLP_ENDPOINT, or the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT) turns it on; the other standard
OTEL_* variables keep their meaning (OTEL_TRACES_SAMPLER, OTEL_BSP_SCHEDULE_DELAY,
OTEL_RESOURCE_ATTRIBUTES, OTEL_SDK_DISABLED=true turns it off again). Every process calls `setup`
once at start, before it builds its server; the rest of the code only ever calls
`server_interceptors`, `call` and `RequestTrace`, which cost nothing when off (no interceptor is
installed, no metadata touched).

W3C trace context (`traceparent`, `tracestate`) travels in gRPC metadata, once per call, never
per message: `call` opens each pipeline call (Generate, Speak, Decode; not the health and load
polls) under a CLIENT span and puts its context into the call's metadata, and the server
interceptor reads it from the invocation metadata and opens the SERVER span, so the stages'
spans share the caller's trace, across migrations too (a replay's call is opened under the
`migrate` span of the stage that moved it). No interceptor touches a call's messages: the
stage-to-stage streams carry one message per token or frame, and grpc.aio's client-side
intercepted calls (what the OpenTelemetry gRPC instrumentation uses) cost more per message than
the rest of its round trip (docs/observability.md, "What tracing costs").
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
import inspect
import json
import logging
import os
import socket
import time
from dataclasses import dataclass

from opentelemetry import trace

from services.base.env import env_default

# The request a log line is about (set by RequestTrace in the handler's task; empty elsewhere).
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("omni_request_id", default="")

PIPELINE_METHODS = ("Generate", "Speak", "Decode")  # of the omni.v1 services (is_pipeline_call)
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
    when an endpoint is configured; True when tracing is on. Call once, before any server is built
    (its interceptors are chosen then)."""
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


def is_pipeline_call(method: str) -> bool:
    """Whether `method` (a full name) carries one request through the pipeline: Omni/Generate,
    Thinker/Generate, Talker/Speak, Code2Wav/Decode. Health checks and load polls (several a second
    per replica) are not traced."""
    return method.startswith("/omni.v1.") and method.rsplit("/", 1)[-1] in PIPELINE_METHODS


def _rpc_attributes(method: str) -> dict:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def call(method: str, multicallable, *args, metadata=None, **kwargs):
    """Open pipeline call `method` (e.g. "/omni.v1.Talker/Speak"): `multicallable(*args,
    metadata=..., **kwargs)`, a stub's method. Tracing off: exactly that, nothing else. On: under a
    CLIENT span, a child of the current one, whose context goes along in the call's metadata
    (`traceparent`, `tracestate`: the global propagator, OTEL_PROPAGATORS); the span ends when the
    call does. Once per call: the call's messages go through no interceptor (grpc.aio's intercepted
    call wraps every read and write, which cost more than the rest of a message's round trip)."""
    if not _STATE.enabled:
        return multicallable(*args, metadata=metadata, **kwargs)
    from opentelemetry import propagate

    span = _TRACER.start_span(method, kind=trace.SpanKind.CLIENT, attributes=_rpc_attributes(method))
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    try:
        opened = multicallable(*args, metadata=(*(metadata or ()), *carrier.items()), **kwargs)
    except BaseException as error:
        span.record_exception(error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()
        raise
    opened.add_done_callback(lambda done: _end_client_span(span, done))
    return opened


_ENDING: set = set()  # the tasks that end client spans (a reference until they ran)


def _end_client_span(span, done_call) -> None:
    """A client span ends when its call does: a stream's end is usually a cancel, once the `final`
    message has arrived (services/serving/streams.py), not the end of its response iterator."""
    import grpc

    async def end() -> None:
        code, details = await done_call.code(), await done_call.details()
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):  # a stream's end is a cancel
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code.name}: {details}"))
        span.end()

    task = asyncio.ensure_future(end())
    _ENDING.add(task)
    task.add_done_callback(_ENDING.discard)


def server_interceptors() -> tuple:
    """The gRPC server interceptors of tracing: none when off; when on, one that opens a SERVER
    span per pipeline call, continuing the caller's trace from its metadata."""
    if not _STATE.enabled:
        return ()
    return (_server_spans(),)


def _server_spans():
    import grpc

    class ServerSpans(grpc.aio.ServerInterceptor):
        """Per call, not per message: the caller's context is read from the invocation metadata
        once, the server span opened and made current in the call's task, and the handler (an
        async generator) driven by `context.write`, which is what grpc.aio itself does with one
        (an extra generator around it would be one more hop per message)."""

        async def intercept_service(self, continuation, handler_call_details):
            handler = await continuation(handler_call_details)
            method = handler_call_details.method
            if (handler is None or not hasattr(handler, "_replace") or not handler.response_streaming
                    or not is_pipeline_call(method)):
                return handler
            kind = "stream_stream" if handler.request_streaming else "unary_stream"
            inner = getattr(handler, kind)
            if not inspect.isasyncgenfunction(inner):
                return handler
            return handler._replace(**{kind: _traced(inner, method, handler_call_details.invocation_metadata)})

    return ServerSpans()


def _traced(inner, method: str, metadata):
    """The streaming handler `inner` run inside a server span, child of the caller's context in
    `metadata`. The handler is closed before the span ends, also when the call is cancelled while
    it waits at a `yield` (else its own `finally`, RequestTrace.finish: outcome and counts, would
    run later, when it is collected, on an ended span)."""
    import grpc
    from opentelemetry import context as otel_context
    from opentelemetry import propagate

    async def traced(request, context) -> None:
        parent = propagate.extract({key: value for key, value in metadata or () if isinstance(value, str)})
        span = _TRACER.start_span(method, context=parent, kind=trace.SpanKind.SERVER,
                                  attributes={**_rpc_attributes(method), **_peer(context.peer())})
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        responses = inner(request, context)
        code = None
        try:
            async for response in responses:
                try:
                    await context.write(response)
                except Exception:  # (ExecuteBatchError) the call ended under the write: the caller left
                    code = grpc.StatusCode.CANCELLED
                    raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:  # context.abort: its code is the context's
            raise
        except Exception as error:
            if code is grpc.StatusCode.CANCELLED:
                raise
            code = grpc.StatusCode.UNKNOWN  # (what grpc makes of a handler's exception)
            span.record_exception(error)
            raise
        finally:
            try:
                await responses.aclose()
            finally:
                _end_server_span(span, context, code)
                otel_context.detach(token)

    return traced


def _end_server_span(span, context, code) -> None:
    """The call's status on its span (the context's own code first: abort and set_code), then end it."""
    import grpc

    code = context.code() or (grpc.StatusCode.CANCELLED if context.cancelled() else code) or grpc.StatusCode.OK
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code.name}: {context.details() or ''}"))
    span.end()


def _peer(peer: str) -> dict:
    """net.peer.ip and net.peer.port of a gRPC peer ("ipv4:127.0.0.1:57284", "ipv6:[::1]:57284")."""
    kind, _, address = (peer or "").partition(":")
    if kind not in ("ipv4", "ipv6"):
        return {}
    ip, _, port = address.split(",")[0].rpartition(":")
    return {"net.peer.ip": ip, "net.peer.port": port}


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

    def prefilled(self, added_ns: int, first_step_ns: int | None) -> None:
        """An LM stage's first output for the request: its `queue` (added to the engine's first
        step for it) and `prefill` (that step to now) phases, once; its `decode` span opens."""
        if self.first("decode"):
            self.phase("queue", added_ns, first_step_ns)
            self.phase("prefill", first_step_ns or added_ns)
            self.open("decode")

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
