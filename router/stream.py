"""One Omni.Generate call, step by step: admit it (a place in flight, or RESOURCE_EXHAUSTED), pick
its route, relay the thinker's stream to the client, move it to another thinker replica if its
replica dies mid-stream (passing up only what the client does not have yet), finish.

`RouterStream.run` is the request's whole path; `pass_up` decides what of each thinker response reaches
the client and `observe` records what the client saw (time to first text and audio, underruns).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from contextlib import aclosing
from typing import Protocol

import grpc

from omni.v1 import omni_pb2, stages_pb2, stages_pb2_grpc
from router.admission import Admission, Rejected
from router.config import RouterConfig
from router.metrics import RouterMetrics
from services.base.stages import SPEECH_SAMPLE_RATE, Stage
from services.serving import tracing
from services.serving.grpc_server import time_remaining
from services.serving.migration import Passed, Resume, as_replay
from services.serving.replicas import Replica, ReplicaSet
from services.serving.status import (
    Overloaded,
    ReplayDiverged,
    StageUnavailable,
    StreamIdle,
    abort_for,
    failure_of_call,
)
from services.serving.streams import read
from services.serving.tracing import RequestTrace, now_ns

log = logging.getLogger("router")


def fix_seeds(request: omni_pb2.GenerateRequest) -> None:
    """A sampled request without a seed gets one now, so a replay after a replica failure draws
    the same tokens (greedy requests need none)."""
    for sampling in (request.thinker_sampling, request.talker_sampling):
        if sampling.temperature > 0 and not sampling.HasField("seed"):
            sampling.seed = secrets.randbits(63)


def outcome_label(code: grpc.StatusCode) -> str:
    """A status as the `outcome` of the router's request counter and trace."""
    return {
        grpc.StatusCode.OK: "ok", grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
        grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected", grpc.StatusCode.UNAVAILABLE: "unavailable",
        grpc.StatusCode.CANCELLED: "cancelled", grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
        grpc.StatusCode.ABORTED: "diverged",
    }.get(code, "error")


async def watched(call, stage: str, replica: str, stall_s: float):
    """The responses of `call`; StreamIdle naming `stage` at `replica` when none comes for `stall_s`
    (the call is cancelled). Reads are never cancelled mid-flight (services/serving/streams.py): in
    the router, over 3,000 cancelled and 3,000 deadline-expired requests (one run each), malloc
    in-use memory grew +1.1 MB with `asyncio.wait_for(anext(...))`, +0.1 MB this way."""
    while True:
        response = await read(call, stall_s, lambda: StreamIdle(stage, stall_s, replica))
        if response is grpc.aio.EOF:
            return
        yield response


class RouterStage(Protocol):
    """What a relay uses of its servicer (router/server.py's OmniServicer)."""

    config: RouterConfig
    admission: Admission
    metrics: RouterMetrics
    stages: dict[str, ReplicaSet]

    def route(self, request: omni_pb2.GenerateRequest) -> tuple[dict[str, Replica], stages_pb2.Route]: ...
    def track(self, route: dict[str, Replica], delta: int) -> None: ...
    def note_failure(self, exc: grpc.aio.AioRpcError, route: dict[str, Replica]) -> None: ...


class RouterStream:
    """One client call's request (`context` is that call's): a place in flight for its whole stream."""

    def __init__(self, servicer: RouterStage, request: omni_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        self.servicer = servicer
        self.metrics = servicer.metrics
        self.request = request
        self.context = context
        self.received, self.received_ns = time.perf_counter(), now_ns()
        self.route: dict[str, Replica] = {}  # stage -> the replica this request holds a place on
        self.thinker_request: stages_pb2.ThinkerRequest | None = None
        self.spans: RequestTrace | None = None
        # What the client has, across moves to other thinker replicas.
        self.text, self.resume = Passed(Stage.THINKER, "text"), Resume(Stage.THINKER)
        self.calls = Passed(Stage.THINKER, "tool calls")  # tool_call_delta and tool_call events, one unit each
        self.tried: set[str] = set()
        self.moves = 0
        self.moved_at: float | None = None  # perf_counter of the last move, until the new replica's first output
        # What the client saw, for its metrics.
        self.first_text = self.first_audio = self.last_audio = None
        self.audio_samples, self.sample_rate = 0, SPEECH_SAMPLE_RATE  # until the first audio chunk says
        self.played_until: float | None = None  # when the audio passed up so far has played (a listener from the first chunk)

    async def run(self):
        await self.admit()
        outcome = grpc.StatusCode.UNKNOWN
        try:
            self.open_route()
            async with aclosing(self.relay()) as responses:
                async for response in responses:
                    yield response
            outcome = grpc.StatusCode.OK
        except ReplayDiverged as exc:
            outcome = grpc.StatusCode.ABORTED
            self.metrics.migrations.labels(Stage.THINKER, "diverged").inc()
            await abort_for(self.context, exc)
        except (StageUnavailable, StreamIdle) as exc:
            outcome = grpc.StatusCode.UNAVAILABLE
            await abort_for(self.context, exc)
        except grpc.aio.AioRpcError as exc:
            outcome = exc.code()
            self.servicer.note_failure(exc, self.route)
            await abort_for(self.context, failure_of_call(Stage.THINKER, self.route[Stage.THINKER].address, exc))
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (grpc closes the generator)
            outcome = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.close(outcome)

    async def admit(self) -> None:
        """A place in flight, after a bounded wait in the queue; RESOURCE_EXHAUSTED when neither has room."""
        admission = self.servicer.admission
        self.metrics.queue_depth.set(admission.queued + 1)
        try:
            await admission.acquire()
        except Rejected as exc:
            self.metrics.requests.labels("rejected").inc()
            await abort_for(self.context, Overloaded(str(exc), self.servicer.config.admission.retry_after_s))
        finally:
            self.metrics.queue_depth.set(admission.queued)
        self.metrics.in_flight.set(admission.in_flight)
        self.metrics.in_flight_peak.set(admission.peak)

    def open_route(self) -> None:
        """The request's id and seeds, fixed for every replay; the least-loaded replica of each stage."""
        request = self.request
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        self.spans = RequestTrace("router", request.request_id)
        self.spans.phase("admission", self.received_ns, in_flight=self.servicer.admission.in_flight)
        fix_seeds(request)
        self.route, stage_route = self.servicer.route(self.request)
        self.spans.set(**{f"omni.route.{stage}": replica.address for stage, replica in self.route.items()})
        self.servicer.track(self.route, +1)
        self.thinker_request = stages_pb2.ThinkerRequest(request=request, route=stage_route)
        self.tried.add(self.route[Stage.THINKER].address)

    async def relay(self):
        """The thinker's stream, to its end; a thinker replica that dies or hangs mid-stream is
        replaced by the next healthy one (at most --max-migrations times)."""
        while True:
            thinker = self.route[Stage.THINKER]
            with self.spans.within("migrate"):  # a replay's call under the `migrate` span of its move
                call = tracing.call(
                    "/omni.v1.Thinker/Generate",
                    stages_pb2_grpc.ThinkerStub(self.servicer.stages[Stage.THINKER].channel(thinker.address)).Generate,
                    self.thinker_request, timeout=time_remaining(self.context))
            try:
                async for response in watched(call, Stage.THINKER, thinker.address, self.servicer.config.thinker_stall_s):
                    response = self.pass_up(response)
                    if response is not None:
                        self.observe(response)
                        yield response
                break
            except (grpc.aio.AioRpcError, StreamIdle) as exc:
                # A dead replica and a hung one (sockets open, nothing sent) move the request alike.
                self.migrate(thinker, exc)
            finally:
                call.cancel()  # no-op when finished; frees every stage when the client went away
        self.spans.count("migrations", self.moves)
        if self.audio_samples:
            self.metrics.rtf.observe((self.last_audio - self.received) / (self.audio_samples / self.sample_rate))

    def pass_up(self, response: omni_pb2.GenerateResponse) -> omni_pb2.GenerateResponse | None:
        """The part of a thinker response the client does not have yet (None: a replay's
        repetition of text, audio or codec frames already passed up)."""
        match response.WhichOneof("event"):
            case "text":
                ids = response.text.token_ids
                if self.text.admit(b"".join(i.to_bytes(4, "little", signed=True) for i in ids), len(ids)):
                    return None
            case "tool_call_delta" | "tool_call":  # a replay makes the same events (the ids too: proto)
                if self.calls.admit(response.SerializeToString(deterministic=True), 1):
                    return None
            case "audio":
                chunk = self.resume.audio_chunk(response.audio)
                if chunk is None:
                    return None
                return omni_pb2.GenerateResponse(request_id=response.request_id, audio=chunk)
            case "codec_frames":
                frames = self.resume.codec_frames(response.codec_frames)
                if frames is None:
                    return None
                return omni_pb2.GenerateResponse(request_id=response.request_id, codec_frames=frames)
            case "final":
                self.text.check_complete()
                self.calls.check_complete()
                self.resume.finish()
                response.final.migrations += self.moves
        return response

    def observe(self, response: omni_pb2.GenerateResponse) -> None:
        """A response on its way to the client: the end of a move's pause, time to first text and
        audio, and underruns of a listener who started playing at the first audio chunk."""
        now = time.perf_counter()
        if self.moved_at is not None:
            self.metrics.migration_pause.labels(Stage.THINKER).observe(now - self.moved_at)
            self.moved_at = None
            self.spans.close("migrate", **{"omni.outcome": "moved"})
        kind = response.WhichOneof("event")
        if kind == "text" and self.first_text is None:
            self.first_text = now
            self.metrics.ttft.observe(now - self.received)
            self.spans.event("first_text")
        elif kind == "audio":
            self.spans.count("audio_chunks")
            if self.first_audio is None:
                self.first_audio = now
                self.metrics.ttfp.observe(now - self.received)
                self.spans.event("first_audio")
            self.last_audio = now
            self.audio_samples += response.audio.num_samples
            self.sample_rate = response.audio.sample_rate or self.sample_rate
            if self.played_until is not None and now > self.played_until:
                self.metrics.underruns.inc()
                self.metrics.underrun_seconds.inc(now - self.played_until)
            self.played_until = max(self.played_until or now, now) + response.audio.num_samples / self.sample_rate

    def migrate(self, thinker: Replica, exc: grpc.aio.AioRpcError | StreamIdle) -> None:
        """Route the request to the next healthy thinker replica, which replays it cut where the
        audio already passed up was cut (so the audio repeats bit for bit); re-raises `exc` when
        it is not the thinker's own failure or no move is left."""
        failure = exc if isinstance(exc, StreamIdle) else failure_of_call(Stage.THINKER, thinker.address, exc)
        if not (isinstance(failure, StageUnavailable | StreamIdle) and failure.stage == Stage.THINKER):
            raise exc
        thinkers = self.servicer.stages[Stage.THINKER]
        thinkers.mark_failed(thinker.address)
        fallback = thinkers.pick(exclude=self.tried)
        if fallback is None or self.moves >= self.servicer.config.max_migrations:
            self.metrics.migrations.labels(Stage.THINKER, "failed").inc()
            self.spans.event("migration_failed", replica=thinker.address, reason=str(failure))
            raise exc
        log.warning("thinker replica %s failed mid-stream (%s); moved request %s to %s (move %d of at most %d)",
                    thinker.address, failure, self.request.request_id, fallback.address, self.moves + 1,
                    self.servicer.config.max_migrations)
        self.metrics.migrations.labels(Stage.THINKER, "moved").inc()
        self.servicer.track({Stage.THINKER: thinker}, -1)
        self.servicer.track({Stage.THINKER: fallback}, +1)
        self.route[Stage.THINKER] = fallback
        self.tried.add(fallback.address)
        self.moves += 1
        self.moved_at = time.perf_counter()
        self.spans.close("migrate", **{"omni.outcome": "ended"})  # moved again before the last move's first output
        self.spans.open("migrate", **{"omni.peer": Stage.THINKER, "omni.from_replica": thinker.address,
                                      "omni.to_replica": fallback.address, "omni.move": self.moves,
                                      "omni.reason": str(failure)})
        self.begin_replay()
        self.thinker_request = as_replay(self.thinker_request)

    def begin_replay(self) -> None:
        """The next thinker's stream repeats what was passed up: `pass_up` drops and checks it."""
        self.text.begin_replay()
        self.calls.begin_replay()
        self.resume.begin_replay()

    def close(self, outcome: grpc.StatusCode) -> None:
        """However the call ended: its trace and count, and its places on the replicas and in flight."""
        if self.spans is not None:
            self.spans.finish(outcome_label(outcome))
        self.metrics.requests.labels(outcome_label(outcome)).inc()
        self.servicer.track(self.route, -1)
        self.servicer.admission.release()
        self.metrics.in_flight.set(self.servicer.admission.in_flight)
