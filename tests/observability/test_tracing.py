"""One request, one trace, across the real processes: the router, thinker, talker and code2wav (and
the HTTP gateway in front) export OpenTelemetry spans over OTLP/gRPC to a collector in this
process (services/tools/otlp_sink.py), and the caller's W3C `traceparent` is continued.

Each request's spans share one trace id and hang together: every span's parent is a span of the
same trace (the root's parent is the caller's span), each stage's server span is the child of the
client span of the stage before it, and each stage records its phases (queue, prefill, first chunk,
decode) under its server span. A request whose code2wav replica is killed mid-stream stays one
trace: the talker's `migrate` span holds the replay's call to the surviving replica. Log lines
(--log-format json) carry the trace and request ids.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.request

import grpc
import pytest

from services.tools.client import build_request, connect
from services.tools.otlp_sink import SpanRecord
from services.tools.soak import read_load

pytestmark = pytest.mark.slow  # a stack of its own: 5 processes, ~1 min to start on 2 busy cores

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
STAGES = {"omni-router", "omni-thinker", "omni-talker", "omni-code2wav"}
SPAN_WAIT_S = 30.0
# (service, span name) every audio request leaves, per process.
AUDIO_SPANS = {
    ("omni-router", "/omni.v1.Omni/Generate"), ("omni-router", "admission"), ("omni-router", "/omni.v1.Thinker/Generate"),
    ("omni-thinker", "/omni.v1.Thinker/Generate"), ("omni-thinker", "prepare"), ("omni-thinker", "queue"),
    ("omni-thinker", "prefill"), ("omni-thinker", "decode"), ("omni-thinker", "/omni.v1.Talker/Speak"),
    ("omni-talker", "/omni.v1.Talker/Speak"), ("omni-talker", "queue"), ("omni-talker", "prefill"),
    ("omni-talker", "first_chunk"), ("omni-talker", "decode"), ("omni-talker", "/omni.v1.Code2Wav/Decode"),
    ("omni-code2wav", "/omni.v1.Code2Wav/Decode"), ("omni-code2wav", "queue"), ("omni-code2wav", "first_chunk"),
    ("omni-code2wav", "decode"),
}
# Each stage's server span and the client span in the process before it that must be its parent.
HOPS = (("omni-router", "/omni.v1.Thinker/Generate", "omni-thinker"),
        ("omni-thinker", "/omni.v1.Talker/Speak", "omni-talker"),
        ("omni-talker", "/omni.v1.Code2Wav/Decode", "omni-code2wav"))


def new_parent() -> tuple[str, str, str]:
    """A caller's span: (trace id, span id, its `traceparent` header)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


class Call:
    """One Generate call in a thread, sent with a `traceparent`; with `hold`, it stops reading after
    its first audio chunk until `release()` (gRPC flow control then holds the stream)."""

    def __init__(self, stack, request, hold: bool = False):
        self.trace_id, self.parent_span_id, header = new_parent()
        self.request_id = request.request_id
        self.streaming, self._release = threading.Event(), threading.Event()
        self.final = None
        self.error: grpc.RpcError | None = None
        if not hold:
            self._release.set()
        self.channel, stub = connect(stack.target)
        self.call = stub.Generate(request, timeout=180, metadata=(("traceparent", header),))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for response in self.call:
                if response.WhichOneof("event") == "audio" and not self.streaming.is_set():
                    self.streaming.set()
                    self._release.wait(120)
                elif response.WhichOneof("event") == "final":
                    self.final = response.final
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.streaming.set()

    def release(self) -> None:
        self._release.set()

    def join(self) -> None:
        self.thread.join(180)
        self.channel.close()
        assert not self.thread.is_alive(), "the request hangs"


def audio_request(request_id: str, frames: int = 60):
    return build_request(f"request {request_id}: tell me about the sea", max_new_tokens=8,
                         talker_max_new_tokens=frames, request_id=request_id)


def spans_of(collector, trace_id: str, expected: set[tuple[str, str]]) -> list[SpanRecord]:
    """The trace's spans, once every expected (service, name) is among them."""
    def complete(spans):
        return expected <= {(s.service, s.name) for s in spans if s.trace_id == trace_id}

    return [s for s in collector.wait_for(complete, SPAN_WAIT_S) if s.trace_id == trace_id]


def assert_one_tree(spans: list[SpanRecord], root_parent: str, lost=lambda span: False) -> SpanRecord:
    """Every span's parent is in the trace, except the root's (the caller's span) and those whose
    parent a killed process took with it (`lost(span)`); returns the root."""
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans), "a span id twice"
    roots = [s for s in spans if s.parent_span_id == root_parent]
    assert len(roots) == 1, [(s.service, s.name) for s in roots]
    orphans = [(s.service, s.name, s.instance) for s in spans
               if s.parent_span_id != root_parent and s.parent_span_id not in by_id and not lost(s)]
    assert not orphans, f"spans whose parent is not in the trace: {orphans}"
    return roots[0]


def assert_hops(spans: list[SpanRecord]) -> None:
    """Each stage's server span is the child of the previous process's client span for that call,
    and the stages' phase spans are children of their own server span."""
    by_id = {s.span_id: s for s in spans}
    for caller, method, callee in HOPS:
        servers = [s for s in spans if s.service == callee and s.name == method and s.kind == SERVER]
        assert servers, f"no {callee} server span"
        for server in servers:
            if server.parent_span_id not in by_id:
                continue  # (the caller was a killed process: assert_one_tree allows it)
            parent = by_id[server.parent_span_id]
            assert (parent.service, parent.name, parent.kind) == (caller, method, CLIENT), (callee, parent)
    for span in spans:
        if span.name in ("queue", "prefill", "first_chunk", "decode", "prepare", "admission") \
                and span.parent_span_id in by_id:
            parent = by_id[span.parent_span_id]
            assert parent.service == span.service and parent.kind == SERVER, (span.service, span.name, parent.name)


def test_each_request_is_one_trace_with_spans_from_all_four_processes_and_correct_parents(traced_stack, collector):
    calls = [Call(traced_stack, audio_request(f"trace-{i}-{secrets.token_hex(4)}")) for i in range(2)]
    for call in calls:
        call.join()
        assert call.error is None, (call.error.code(), call.error.details())
    for call in calls:
        spans = spans_of(collector, call.trace_id, AUDIO_SPANS)
        assert {s.service for s in spans} == STAGES
        root = assert_one_tree(spans, call.parent_span_id)
        assert (root.service, root.name, root.kind) == ("omni-router", "/omni.v1.Omni/Generate", SERVER)
        assert_hops(spans)
        servers = [s for s in spans if s.kind == SERVER]
        assert {s.attributes["omni.request_id"] for s in servers} == {call.request_id}
        assert all(s.attributes["omni.outcome"] == "ok" for s in servers), [s.attributes for s in servers]
        assert all(s.attributes["omni.replica"] for s in servers)
        thinker = next(s for s in servers if s.service == "omni-thinker")
        assert thinker.attributes["omni.text_tokens"] == 8  # decode summarised as a count, not a span a token
        assert {"first_token", "first_audio"} <= set(thinker.events)
        assert root.attributes["omni.route.code2wav"] in traced_stack.addresses("code2wav")
        # One trace per request: no span of this request in any other trace.
        elsewhere = {s.trace_id for s in collector.spans() if s.attributes.get("omni.request_id") == call.request_id}
        assert elsewhere == {call.trace_id}
    assert sum(1 for s in collector.spans() if s.name == "decode" and s.service == "omni-thinker"
               and s.trace_id in {c.trace_id for c in calls}) == 2  # never a span per token


def test_a_cancelled_request_ends_its_spans_as_cancelled_in_every_stage(traced_stack, collector):
    call = Call(traced_stack, audio_request(f"cancel-{secrets.token_hex(4)}", frames=250), hold=True)
    assert call.streaming.wait(120)
    call.call.cancel()
    call.release()
    call.join()
    assert call.error is not None and call.error.code() is grpc.StatusCode.CANCELLED

    def ended_everywhere(spans):
        return {s.service for s in spans if s.trace_id == call.trace_id and s.kind == SERVER} == STAGES

    spans = [s for s in collector.wait_for(ended_everywhere, SPAN_WAIT_S) if s.trace_id == call.trace_id]
    assert_one_tree(spans, call.parent_span_id)
    servers = {s.service: s for s in spans if s.kind == SERVER}
    outcomes = {service: s.attributes.get("omni.outcome") for service, s in servers.items()}
    assert outcomes == dict.fromkeys(STAGES, "cancelled"), outcomes
    assert all("cancelled" in s.events for s in servers.values())


def test_the_gateway_continues_the_http_callers_traceparent_into_the_pipeline(traced_stack, collector):
    trace_id, span_id, header = new_parent()
    with urllib.request.urlopen(traced_stack.http_url + "/v1/models", timeout=30) as response:
        model = json.load(response)["data"][0]["id"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4})
    request = urllib.request.Request(traced_stack.http_url + "/v1/chat/completions", data=body.encode(), method="POST",
                                     headers={"content-type": "application/json", "traceparent": header})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200 and json.load(response)["choices"][0]["message"]["content"]
    spans = spans_of(collector, trace_id, {("omni-gateway", "POST /v1/chat/completions"),
                                           ("omni-gateway", "/omni.v1.Omni/Generate"),
                                           ("omni-router", "/omni.v1.Omni/Generate"),
                                           ("omni-thinker", "/omni.v1.Thinker/Generate"), ("omni-thinker", "decode")})
    root = assert_one_tree(spans, span_id)
    assert (root.service, root.name, root.kind) == ("omni-gateway", "POST /v1/chat/completions", SERVER)
    assert root.attributes["http.response.status_code"] == 200
    by_id = {s.span_id: s for s in spans}
    router = next(s for s in spans if s.service == "omni-router" and s.kind == SERVER)
    assert (by_id[router.parent_span_id].service, by_id[router.parent_span_id].kind) == ("omni-gateway", CLIENT)


def holding_replica(stack, call, stage: str) -> tuple[str, str]:
    """(process name, address) of the `stage` replica holding `call`, once it streams: the only
    one with a request in flight."""
    assert call.streaming.wait(120) and call.error is None
    loads = {a: read_load(stage, a).in_flight for a in stack.addresses(stage)}
    address = max(loads, key=loads.get)
    assert loads[address] == 1, loads
    name = next(name for name, p in stack.processes.items() if p.stage == stage and f"127.0.0.1:{p.port}" == address)
    return name, address


def kill_and_complete(stack, call, victim: str) -> int:
    """Kill `victim` (-9), let the held call go on: it must complete, moved once. -> when the kill
    was sent (time.time_ns)."""
    killed_ns = time.time_ns()
    stack.kill(victim)
    stack.processes[victim].popen.wait(10)
    call.release()
    call.join()
    assert call.error is None, (call.error.code(), call.error.details())
    assert call.final.migrations == 1
    return killed_ns


def test_a_request_moved_off_a_killed_code2wav_replica_stays_one_trace_under_a_migrate_span(traced_stack, collector):
    call = Call(traced_stack, audio_request(f"move-{secrets.token_hex(4)}", frames=250), hold=True)
    victim = None
    try:
        victim, address = holding_replica(traced_stack, call, "code2wav")
        kill_and_complete(traced_stack, call, victim)
        port = address.rsplit(":", 1)[1]
        (survivor,) = (a for a in traced_stack.addresses("code2wav") if a != address)

        def moved(spans):
            mine = [s for s in spans if s.trace_id == call.trace_id]
            resumed = [s for s in mine if s.service == "omni-code2wav" and s.kind == SERVER
                       and s.instance.endswith(":" + survivor.rsplit(":", 1)[1])]
            ids = {s.span_id for s in mine}  # (the replay's client span may come in a later export than its server's)
            return AUDIO_SPANS <= {(s.service, s.name) for s in mine} and any(s.name == "migrate" for s in mine) \
                and any(s.parent_span_id in ids for s in resumed)

        spans = [s for s in collector.wait_for(moved, SPAN_WAIT_S) if s.trace_id == call.trace_id]
        # The killed replica's open server span died with it; the phases it had exported are orphans.
        assert_one_tree(spans, call.parent_span_id, lost=lambda s: s.instance.endswith(f":{port}"))
        assert_hops(spans)
        by_id = {s.span_id: s for s in spans}
        (migrate,) = [s for s in spans if s.name == "migrate"]
        assert migrate.service == "omni-talker"
        assert migrate.attributes["omni.peer"] == "code2wav" and migrate.attributes["omni.outcome"] == "moved"
        assert migrate.attributes["omni.from_replica"] == address and migrate.attributes["omni.to_replica"] == survivor
        assert by_id[migrate.parent_span_id].name == "/omni.v1.Talker/Speak"
        # The replay's call hangs under `migrate`, and the surviving replica's server span under it.
        (replay,) = [s for s in spans if s.parent_span_id == migrate.span_id]
        assert (replay.name, replay.kind) == ("/omni.v1.Code2Wav/Decode", CLIENT)
        (resumed,) = [s for s in spans if s.parent_span_id == replay.span_id]
        assert resumed.service == "omni-code2wav" and resumed.attributes["omni.outcome"] == "ok"
        talker = next(s for s in spans if s.service == "omni-talker" and s.kind == SERVER)
        assert talker.attributes["omni.migrations"] == 1
        # The talker's log line about the move, as JSON, with the request's trace and request ids.
        lines = [json.loads(line) for p in traced_stack.processes.values() if p.stage == "talker"
                 for line in list(p.output) if line.startswith("{")]
        (moved_line,) = [line for line in lines if "moved the request" in line["message"]]
        assert moved_line["trace_id"] == call.trace_id and moved_line["request_id"] == call.request_id
        assert moved_line["service"] == "talker" and moved_line["level"] == "WARNING"
    finally:
        call.release()
        if victim is not None:
            traced_stack.restart(victim)


def chain(spans: list[SpanRecord], top: SpanRecord) -> list[tuple[str, str, int]]:
    """(service, name, kind) of the gRPC spans below `top`, following the first call span down."""
    below, span = [], top
    while True:
        children = [s for s in spans if s.parent_span_id == span.span_id and s.name.startswith("/omni.v1.")]
        if not children:
            return below
        span = children[0]
        below.append((span.service, span.name, span.kind))


def test_a_request_moved_off_a_killed_thinker_replica_stays_one_trace_under_the_router_s_migrate_span(
        traced_stack, collector):
    call = Call(traced_stack, audio_request(f"move-thinker-{secrets.token_hex(4)}", frames=250), hold=True)
    victim = None
    try:
        victim, address = holding_replica(traced_stack, call, "thinker")
        killed_ns = kill_and_complete(traced_stack, call, victim)
        (survivor,) = (a for a in traced_stack.addresses("thinker") if a != address)
        replay = [("omni-router", "/omni.v1.Thinker/Generate", CLIENT), ("omni-thinker", "/omni.v1.Thinker/Generate", SERVER),
                  ("omni-thinker", "/omni.v1.Talker/Speak", CLIENT), ("omni-talker", "/omni.v1.Talker/Speak", SERVER),
                  ("omni-talker", "/omni.v1.Code2Wav/Decode", CLIENT), ("omni-code2wav", "/omni.v1.Code2Wav/Decode", SERVER)]

        def moved(spans):
            mine = [s for s in spans if s.trace_id == call.trace_id]
            return any(s.name == "migrate" and chain(mine, s) == replay for s in mine)

        spans = [s for s in collector.wait_for(moved, SPAN_WAIT_S) if s.trace_id == call.trace_id]
        # What the dead thinker held: its own spans, and the talker and code2wav streams it had
        # opened (their parent, its client span, died with it). Nothing opened after the kill is cut off.
        port = address.rsplit(":", 1)[1]
        assert_one_tree(spans, call.parent_span_id, lost=lambda s: s.instance.endswith(f":{port}") or s.start_ns < killed_ns)
        assert_hops(spans)
        (migrate,) = [s for s in spans if s.name == "migrate"]
        assert migrate.service == "omni-router" and migrate.attributes["omni.outcome"] == "moved"
        assert migrate.attributes["omni.from_replica"] == address and migrate.attributes["omni.to_replica"] == survivor
        by_id = {s.span_id: s for s in spans}
        assert by_id[migrate.parent_span_id].name == "/omni.v1.Omni/Generate"
        resumed = next(s for s in spans if s.service == "omni-thinker" and s.kind == SERVER
                       and s.instance.endswith(":" + survivor.rsplit(":", 1)[1]))
        assert resumed.attributes["omni.replay"] is True and resumed.attributes["omni.outcome"] == "ok"
        router = next(s for s in spans if s.service == "omni-router" and s.kind == SERVER)
        assert router.attributes["omni.migrations"] == 1 and router.attributes["omni.outcome"] == "ok"
    finally:
        call.release()
        if victim is not None:
            traced_stack.restart(victim)
