"""The router: the client-facing `omni.v1.Omni/Generate`.

Admits the request (bounded in-flight count and queue; RESOURCE_EXHAUSTED beyond them), picks
the least-loaded healthy replica of each stage, puts that route in the call to the thinker, and
streams text deltas and audio chunks back to the client as they come. The client's deadline is
handed on to the thinker (which hands it on down the pipeline); a cancelled client call cancels
the thinker call, which cancels the talker and code2wav streams, freeing the work everywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import sys
import time
import uuid
from dataclasses import dataclass

import grpc

from omni.v1 import omni_pb2, omni_pb2_grpc, stages_pb2, stages_pb2_grpc
from router.admission import Admission, AdmissionConfig, Rejected
from router.metrics import RouterMetrics
from router.replicas import Replica, ReplicaSet, ReplicaSource, publish_state
from services.runtime.errors import run_cli
from services.runtime.settings import env_default
from services.serving import tracing
from services.serving.config import ServingConfig, add_serving_flags, serving_config_from_args
from services.serving.grpc_server import (
    ServerHandle,
    build_server,
    channel_options,
    serve_until_signal,
    setup_logging,
    time_remaining,
    write_port_file,
)
from services.serving.migration import Passed, Resume, with_cuts
from services.serving.security import (
    BearerTokenInterceptor,
    load_tokens,
)
from services.serving.status import (
    STAGE_UNAVAILABLE,
    Overloaded,
    ReplayDiverged,
    StageUnavailable,
    StreamIdle,
    abort_for,
    error_info,
    failure_of_call,
)
from services.serving.streams import read
from services.serving.tracing import RequestTrace, now_ns
from services.serving.tracing import setup as setup_tracing

log = logging.getLogger("router")
SERVICE = omni_pb2.DESCRIPTOR.services_by_name["Omni"].full_name
STAGES = ("thinker", "talker", "code2wav")


@dataclass(frozen=True)
class RouterConfig:
    thinker: ReplicaSource
    talker: ReplicaSource
    code2wav: ReplicaSource
    # Where it listens, message limit, grace, metrics, TLS (client -> router and router -> thinker,
    # and the stages' health/load), health port, the stages' idle timeout: what every server has.
    serving: ServingConfig = ServingConfig(port=50051)
    admission: AdmissionConfig = AdmissionConfig()
    poll_interval_s: float = 1.0
    dns_refresh_s: float = 5.0
    auth_tokens: tuple[bytes, ...] = ()  # bearer tokens callers must present; empty = no authentication
    max_migrations: int = 2  # moves to another replica per request and hop when one dies mid-stream

    @property
    def thinker_stall_s(self) -> float:
        """A thinker replica that sends nothing this long is taken as hung: one step above the
        thinker's own wait on the two stages below it (ServingConfig.stall_timeout_s), 2.5x the
        idle timeout."""
        return self.serving.stall_timeout_s(stages_below=3)


def fix_seeds(request: omni_pb2.GenerateRequest) -> None:
    """A sampled request without a seed gets one now, so a replay after a replica failure draws
    the same tokens (greedy requests need none)."""
    for sampling in (request.thinker_sampling, request.talker_sampling):
        if sampling.temperature > 0 and not sampling.HasField("seed"):
            sampling.seed = secrets.randbits(63)


def _outcome(code: grpc.StatusCode) -> str:
    return {
        grpc.StatusCode.OK: "ok", grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
        grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected", grpc.StatusCode.UNAVAILABLE: "unavailable",
        grpc.StatusCode.CANCELLED: "cancelled", grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
        grpc.StatusCode.ABORTED: "diverged",
    }.get(code, "error")


class OmniServicer(omni_pb2_grpc.OmniServicer):
    def __init__(self, config: RouterConfig, stages: dict[str, ReplicaSet], metrics: RouterMetrics):
        self.config = config
        self.stages = stages  # stage name -> its replicas
        self.admission = Admission(config.admission)
        self.metrics = metrics

    def _route(self) -> tuple[dict[str, Replica], stages_pb2.Route]:
        """The least-loaded healthy replica of each stage, and the route the thinker gets: those
        for the talker and code2wav plus every other healthy one of theirs as fallbacks, least
        loaded first."""
        route, ranked = {}, {}
        for stage in STAGES:
            ranked[stage] = self.stages[stage].ranked()
            if not ranked[stage]:
                raise StageUnavailable(stage, "no replica", "no healthy replica")
            route[stage] = ranked[stage][0]
        return route, stages_pb2.Route(
            talker=route["talker"].address, code2wav=route["code2wav"].address,
            talker_fallbacks=[r.address for r in ranked["talker"][1:]],
            code2wav_fallbacks=[r.address for r in ranked["code2wav"][1:]],
            max_migrations=self.config.max_migrations)

    def _track(self, route: dict[str, Replica], delta: int) -> None:
        for stage, replica in route.items():
            replica.in_flight += delta
            self.metrics.replica_in_flight.labels(stage, replica.address).set(replica.in_flight)

    async def Generate(self, request: omni_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        received, received_ns = time.perf_counter(), now_ns()
        self.metrics.queue_depth.set(self.admission.queued + 1)
        try:
            await self.admission.acquire()
        except Rejected as exc:
            self.metrics.requests.labels("rejected").inc()
            await abort_for(context, Overloaded(str(exc), self.config.admission.retry_after_s))
        finally:
            self.metrics.queue_depth.set(self.admission.queued)
        self.metrics.in_flight.set(self.admission.in_flight)
        self.metrics.in_flight_peak.set(self.admission.peak)
        route: dict[str, Replica] = {}
        outcome = grpc.StatusCode.UNKNOWN
        spans: RequestTrace | None = None
        try:
            if not request.request_id:
                request.request_id = uuid.uuid4().hex
            spans = RequestTrace("router", request.request_id)
            spans.phase("admission", received_ns, in_flight=self.admission.in_flight)
            fix_seeds(request)
            route, stage_route = self._route()
            spans.set(**{f"omni.route.{stage}": replica.address for stage, replica in route.items()})
            self._track(route, +1)
            async for response in self._stream(request, route, stage_route, context, received, spans):
                yield response
            outcome = grpc.StatusCode.OK
        except ReplayDiverged as exc:
            outcome = grpc.StatusCode.ABORTED
            self.metrics.migrations.labels("thinker", "diverged").inc()
            await abort_for(context, exc)
        except (StageUnavailable, StreamIdle) as exc:
            outcome = grpc.StatusCode.UNAVAILABLE
            await abort_for(context, exc)
        except grpc.aio.AioRpcError as exc:
            outcome = exc.code()
            self._note_failure(exc, route)
            await abort_for(context, failure_of_call("thinker", route["thinker"].address, exc))
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (grpc closes the generator)
            outcome = grpc.StatusCode.CANCELLED
            raise
        finally:
            if spans is not None:
                spans.finish(_outcome(outcome))
            self.metrics.requests.labels(_outcome(outcome)).inc()
            self._track(route, -1)
            self.admission.release()
            self.metrics.in_flight.set(self.admission.in_flight)

    async def _stream(self, request, route: dict[str, Replica], stage_route: stages_pb2.Route, context,
                      received: float, spans: RequestTrace):
        """Relay the thinker's stream. When the thinker replica dies mid-stream, re-send the request
        to the next healthy one (at most --max-migrations times) and pass up only what the client
        does not have yet: text tokens, audio samples and codec frames past those delivered."""
        thinker_request = stages_pb2.ThinkerRequest(request=request, route=stage_route)
        text, resume = Passed("thinker", "text"), Resume("thinker")
        tried, moves, moved_at = {route["thinker"].address}, 0, None
        first_text = first_audio = last_audio = None
        audio_samples, sample_rate = 0, 24000
        played_until = None  # perf_counter when the audio passed up so far has played (a listener from the first chunk)
        while True:
            thinker = route["thinker"]
            with spans.within("migrate"):  # a replay's call under the `migrate` span of its move
                call = tracing.call(
                    "/omni.v1.Thinker/Generate",
                    stages_pb2_grpc.ThinkerStub(self.stages["thinker"].channel(thinker.address)).Generate,
                    thinker_request, timeout=time_remaining(context))
            try:
                async for response in _watched(call, "thinker", thinker.address, self.config.thinker_stall_s):
                    kind = response.WhichOneof("event")
                    if kind == "text":
                        ids = response.text.token_ids
                        if text.admit(b"".join(i.to_bytes(4, "little", signed=True) for i in ids), len(ids)):
                            continue  # a replay's repetition of text the client has
                    elif kind == "audio":
                        chunk = resume.audio_chunk(response.audio)
                        if chunk is None:
                            continue
                        response = omni_pb2.GenerateResponse(request_id=response.request_id, audio=chunk)
                    elif kind == "codec_frames":
                        frames = resume.codec_frames(response.codec_frames)
                        if frames is None:
                            continue
                        response = omni_pb2.GenerateResponse(request_id=response.request_id, codec_frames=frames)
                    elif kind == "final":
                        text.check_complete()
                        resume.finish()
                        response.final.migrations += moves
                    now = time.perf_counter()
                    if moved_at is not None:
                        self.metrics.migration_pause.labels("thinker").observe(now - moved_at)
                        moved_at = None
                        spans.close("migrate", **{"omni.outcome": "moved"})
                    if kind == "text" and first_text is None:
                        first_text = now
                        self.metrics.ttft.observe(now - received)
                        spans.event("first_text")
                    elif kind == "audio":
                        spans.count("audio_chunks")
                        if first_audio is None:
                            first_audio = now
                            self.metrics.ttfp.observe(now - received)
                            spans.event("first_audio")
                        last_audio = now
                        audio_samples += response.audio.num_samples
                        sample_rate = response.audio.sample_rate or sample_rate
                        if played_until is not None and now > played_until:
                            self.metrics.underruns.inc()
                            self.metrics.underrun_seconds.inc(now - played_until)
                        played_until = max(played_until or now, now) + response.audio.num_samples / sample_rate
                    yield response
                break
            except (grpc.aio.AioRpcError, StreamIdle) as exc:
                # A dead replica and a hung one (sockets open, nothing sent) move the request alike.
                failure = exc if isinstance(exc, StreamIdle) else failure_of_call("thinker", thinker.address, exc)
                if not (isinstance(failure, StageUnavailable | StreamIdle) and failure.stage == "thinker"):
                    raise
                self.stages["thinker"].mark_failed(thinker.address)
                fallback = self.stages["thinker"].pick(exclude=tried)
                if fallback is None or moves >= self.config.max_migrations:
                    self.metrics.migrations.labels("thinker", "failed").inc()
                    spans.event("migration_failed", replica=thinker.address, reason=str(failure))
                    raise
                log.warning("thinker replica %s failed mid-stream (%s); moved request %s to %s (move %d of at most %d)",
                            thinker.address, failure, request.request_id, fallback.address, moves + 1,
                            self.config.max_migrations)
                self.metrics.migrations.labels("thinker", "moved").inc()
                self._track({"thinker": thinker}, -1)
                self._track({"thinker": fallback}, +1)
                route["thinker"] = fallback
                tried.add(fallback.address)
                moves += 1
                moved_at = time.perf_counter()
                spans.close("migrate", **{"omni.outcome": "ended"})  # moved again before the last move's first output
                spans.open("migrate", **{"omni.peer": "thinker", "omni.from_replica": thinker.address,
                                         "omni.to_replica": fallback.address, "omni.move": moves,
                                         "omni.reason": str(failure)})
                text.begin_replay()
                resume.begin_replay()
                thinker_request = with_cuts(thinker_request, resume.cuts)  # the audio repeats bit for bit
            finally:
                call.cancel()  # no-op when finished; frees every stage when the client went away
        spans.count("migrations", moves)
        if audio_samples:
            self.metrics.rtf.observe((last_audio - received) / (audio_samples / sample_rate))

    def _note_failure(self, exc: grpc.aio.AioRpcError, route: dict[str, Replica]) -> None:
        """Mark the replica an UNAVAILABLE's ErrorInfo names (or the thinker, if it died itself) as failed."""
        if exc.code() is not grpc.StatusCode.UNAVAILABLE:
            return
        info = error_info(exc)
        if info is not None and info.reason == STAGE_UNAVAILABLE and info.metadata.get("stage") in self.stages:
            self.stages[info.metadata["stage"]].mark_failed(info.metadata["replica"])
        elif info is None and route:
            self.stages["thinker"].mark_failed(route["thinker"].address)


class Router:
    """The replica sets, the servicer and the readiness they imply."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.metrics = RouterMetrics()
        options = channel_options(config.serving.max_message_bytes)
        self.stages = {
            stage: ReplicaSet(stage, getattr(config, stage), options, config.poll_interval_s, config.dns_refresh_s,
                              config.serving.tls)
            for stage in STAGES
        }
        self.servicer = OmniServicer(config, self.stages, self.metrics)

    @property
    def ready(self) -> bool:
        return all(any(r.healthy and not r.draining for r in s.replicas.values()) for s in self.stages.values())

    async def start(self) -> None:
        await asyncio.gather(*(s.refresh() for s in self.stages.values()))
        for replica_set in self.stages.values():
            replica_set.start()

    async def keep_health(self, handle: ServerHandle) -> None:
        """Readiness under the service name omni.v1.Omni: SERVING while every stage has a healthy
        replica. The overall status "" says only that the router is up (liveness) until it drains."""
        serving = None
        while True:
            for stage, replica_set in self.stages.items():
                for replica in replica_set.replicas.values():
                    self.metrics.replica_healthy.labels(stage, replica.address).set(
                        int(replica.healthy and not replica.draining))
                    publish_state(self.metrics, stage, replica)
            if self.ready != serving and not handle.draining:
                serving = self.ready
                await handle.set_serving(serving, services=(SERVICE,))
                log.info("router %s", "ready" if serving else "not ready: a stage has no healthy replica")
            await asyncio.sleep(self.config.poll_interval_s / 2)


async def _watched(call, stage: str, replica: str, stall_s: float):
    """The responses of `call`; StreamIdle naming `stage` at `replica` when none comes for `stall_s`
    (the call is cancelled). Reads are never cancelled mid-flight (services/serving/streams.py): in
    the router, over 3,000 cancelled and 3,000 deadline-expired requests (one run each), malloc
    in-use memory grew +1.1 MB with `asyncio.wait_for(anext(...))`, +0.1 MB this way."""
    while True:
        response = await read(call, stall_s, lambda: StreamIdle(stage, stall_s, replica))
        if response is grpc.aio.EOF:
            return
        yield response


async def create_server(config: RouterConfig) -> tuple[ServerHandle, Router]:
    router = Router(config)
    await router.start()
    interceptors = (BearerTokenInterceptor(config.auth_tokens),) if config.auth_tokens else ()
    serving = config.serving
    handle = build_server(serving.host, serving.port, (SERVICE,), serving.max_message_bytes, tls=serving.tls,
                          interceptors=interceptors, health_port=serving.health_port)
    omni_pb2_grpc.add_OmniServicer_to_server(router.servicer, handle.server)
    router.metrics.in_flight_limit.set(config.admission.max_in_flight)
    router.metrics.queue_limit.set(config.admission.max_queue)
    router.metrics.serve(serving.metrics_port)
    return handle, router


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-router", description=__doc__.splitlines()[0])
    # Clients' messages are smaller than what stages pass each other (a whole prompt's hidden states).
    add_serving_flags(parser, default_port=50051, max_message_mb=64, idle_timeout_help=(
        "the stages' idle timeout: a thinker replica silent for 2.5x this is taken as hung (default 120)"))
    for stage, port in (("thinker", 50061), ("talker", 50062), ("code2wav", 50063)):
        parser.add_argument(f"--{stage}", default=env_default(stage, f"localhost:{port}"),
                            help=f"{stage} replicas: host:port[,host:port] or dns:///name:port")
    parser.add_argument("--max-in-flight", type=int, default=env_default("max_in_flight", 64),
                        help="requests streaming at once (default 64)")
    parser.add_argument("--max-queue", type=int, default=env_default("max_queue", 128),
                        help="requests waiting for a place (default 128)")
    parser.add_argument("--queue-timeout-s", type=float, default=env_default("queue_timeout_s", 10.0),
                        help="longest wait for a place before RESOURCE_EXHAUSTED (default 10)")
    parser.add_argument("--poll-interval-s", type=float, default=env_default("poll_interval_s", 1.0),
                        help="health and load poll of every replica (default 1)")
    parser.add_argument("--dns-refresh-s", type=float, default=env_default("dns_refresh_s", 5.0))
    parser.add_argument("--auth-token-file", default=env_default("auth_token_file", None),
                        help="bearer tokens callers must present, one per line (also OMNI_AUTH_TOKENS, "
                             "comma-separated); none given = no authentication")
    parser.add_argument("--max-migrations", type=int, default=env_default("max_migrations", 2),
                        help="times a request may move to another replica of a stage whose replica dies "
                             "mid-stream, per hop (default 2; 0 = fail the request instead)")
    args = parser.parse_args(argv)

    def run() -> None:
        config = RouterConfig(
            thinker=ReplicaSource.parse(args.thinker, "--thinker"),
            talker=ReplicaSource.parse(args.talker, "--talker"),
            code2wav=ReplicaSource.parse(args.code2wav, "--code2wav"),
            serving=serving_config_from_args(args),
            admission=AdmissionConfig(args.max_in_flight, args.max_queue, args.queue_timeout_s),
            poll_interval_s=args.poll_interval_s, dns_refresh_s=args.dns_refresh_s,
            auth_tokens=load_tokens(args.auth_token_file), max_migrations=args.max_migrations,
        )
        setup_logging("router", config.serving.tracing.log_format)
        setup_tracing("router", config.serving.tracing, config.serving.port)

        async def serve() -> None:
            handle, router = await create_server(config)
            health = None
            await handle.set_serving(False, services=(SERVICE,))  # not ready until every stage has a replica

            def started() -> None:
                nonlocal health
                write_port_file(args.port_file, handle.port)
                health = asyncio.get_running_loop().create_task(router.keep_health(handle))

            await serve_until_signal(handle, config.serving.grace_s, drain_delay_s=config.serving.drain_delay_s,
                                     on_started=started,
                                     light_load_cpus=config.serving.light_load_cpus)

            if health is not None:
                health.cancel()

        asyncio.run(serve())

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
