"""The router: the client-facing `omni.v1.Omni/Generate` (and `GetModelInfo`, from the thinker
replicas' load reports).

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
import sys
from contextlib import aclosing

import grpc

from omni.v1 import omni_pb2, omni_pb2_grpc, stages_pb2
from router.admission import Admission, AdmissionConfig
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.stream import RouterStream
from services.base.env import env_default
from services.base.errors import run_cli
from services.base.stages import Stage
from services.serving import loop_lag
from services.serving.config import add_serving_flags, serving_config_from_args
from services.serving.grpc_server import (
    ServerHandle,
    build_server,
    channel_options,
    run_process,
    serve_until_signal,
    write_port_file,
)
from services.serving.prefix_keys import message_keys
from services.serving.prefix_routing import DEFAULT_PREFIX_WEIGHT, Routing
from services.serving.replicas import Replica, ReplicaSet, ReplicaSource, publish_state
from services.serving.security import (
    BearerTokenInterceptor,
    load_tokens,
)
from services.serving.status import (
    STAGE_UNAVAILABLE,
    StageUnavailable,
    error_info,
)

log = logging.getLogger("router")
SERVICE = omni_pb2.DESCRIPTOR.services_by_name["Omni"].full_name
STAGES = tuple(Stage)


class OmniServicer(omni_pb2_grpc.OmniServicer):
    def __init__(self, config: RouterConfig, stages: dict[str, ReplicaSet], metrics: RouterMetrics):
        self.config = config
        self.stages = stages  # stage name -> its replicas
        self.admission = Admission(config.admission)
        self.metrics = metrics

    def route(self, request: omni_pb2.GenerateRequest) -> tuple[dict[str, Replica], stages_pb2.Route]:
        """The cheapest healthy replica of each stage (least loaded; for the thinker, less the
        credit of the request's prefix it holds: services/serving/prefix_routing.py), and the route
        the thinker gets: those for the talker and code2wav plus every other healthy one of theirs
        as fallbacks, least loaded first."""
        route, ranked = {}, {}
        for stage in STAGES:
            keys = self.prefix_keys(request) if stage == Stage.THINKER else ()
            ranked[stage] = self.stages[stage].ranked(prefix_keys=keys)
            if not ranked[stage]:
                raise StageUnavailable(stage, "no replica", "no healthy replica")
            route[stage] = ranked[stage][0]
        return route, stages_pb2.Route(
            talker=route[Stage.TALKER].address, code2wav=route[Stage.CODE2WAV].address,
            talker_fallbacks=[r.address for r in ranked[Stage.TALKER][1:]],
            code2wav_fallbacks=[r.address for r in ranked[Stage.CODE2WAV][1:]],
            max_migrations=self.config.max_migrations)

    def prefix_keys(self, request: omni_pb2.GenerateRequest) -> list[bytes]:
        """The request's message keys, when prefix routing has more than one thinker to choose from."""
        thinkers = self.stages[Stage.THINKER]
        if thinkers.routing is not Routing.PREFIX or len(thinkers.replicas) < 2:
            return []
        keys = message_keys(request)
        held = max((r.prefix.matched(keys) for r in thinkers.replicas.values()), default=0)
        self.metrics.prefix_routed.labels("held" if held else "none").inc()
        return keys

    def track(self, route: dict[str, Replica], delta: int) -> None:
        for stage, replica in route.items():
            replica.in_flight += delta
            self.metrics.replica_in_flight.labels(stage, replica.address).set(replica.in_flight)

    async def Generate(self, request: omni_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        async with aclosing(RouterStream(self, request, context).run()) as responses:
            async for response in responses:
                yield response

    async def GetModelInfo(self, request: omni_pb2.ModelInfoRequest, context) -> omni_pb2.ModelInfo:
        """From the thinker replicas' last load reports: tools are taken when every one that said takes them."""
        said = [r.load.tools for r in self.stages[Stage.THINKER].replicas.values()
                if r.healthy and r.load is not None and r.load.HasField("tools")]
        return omni_pb2.ModelInfo(tools=all(said)) if said else omni_pb2.ModelInfo()

    def note_failure(self, exc: grpc.aio.AioRpcError, route: dict[str, Replica]) -> None:
        """Mark the replica an UNAVAILABLE's ErrorInfo names (or the thinker, if it died itself) as failed."""
        if exc.code() is not grpc.StatusCode.UNAVAILABLE:
            return
        info = error_info(exc)
        if info is not None and info.reason == STAGE_UNAVAILABLE and info.metadata.get("stage") in self.stages:
            self.stages[info.metadata["stage"]].mark_failed(info.metadata["replica"])
        elif info is None and route:
            self.stages[Stage.THINKER].mark_failed(route[Stage.THINKER].address)


class Router:
    """The replica sets, the servicer and the readiness they imply."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.metrics = RouterMetrics()
        options = channel_options(config.serving.max_message_bytes)
        self.stages = {
            stage: ReplicaSet(stage, getattr(config, stage), options, config.poll_interval_s, config.dns_refresh_s,
                              config.serving.tls, routing=config.routing if stage == Stage.THINKER else Routing.LEAST_LOADED,
                              prefix_weight=config.prefix_weight)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-router", description=__doc__.splitlines()[0])
    # Clients' messages are smaller than what stages pass each other (a whole prompt's hidden states).
    add_serving_flags(parser, default_port=50051, max_message_mb=64, idle_timeout_help=(
        "the stages' idle timeout: a thinker replica silent for 2.5x this is taken as hung (default 120)"))
    for stage, port in ((Stage.THINKER, 50061), (Stage.TALKER, 50062), (Stage.CODE2WAV, 50063)):
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
    parser.add_argument("--routing", choices=list(Routing), type=Routing, default=env_default("routing", Routing.PREFIX),
                        help="thinker replica choice: prefix (least loaded, less the credit of the conversation's "
                             "prefix a replica holds in its prefix cache), least-loaded, or random (default prefix)")
    parser.add_argument("--prefix-weight", type=float, default=env_default("prefix_weight", DEFAULT_PREFIX_WEIGHT),
                        help="prefix routing: requests of load that 1,000 prompt tokens a replica holds are worth "
                             f"(default {DEFAULT_PREFIX_WEIGHT:g})")
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        thinker=ReplicaSource.parse(args.thinker, "--thinker"),
        talker=ReplicaSource.parse(args.talker, "--talker"),
        code2wav=ReplicaSource.parse(args.code2wav, "--code2wav"),
        serving=serving_config_from_args(args),
        admission=AdmissionConfig(args.max_in_flight, args.max_queue, args.queue_timeout_s),
        poll_interval_s=args.poll_interval_s, dns_refresh_s=args.dns_refresh_s,
        auth_tokens=load_tokens(args.auth_token_file), max_migrations=args.max_migrations,
        routing=Routing(args.routing), prefix_weight=args.prefix_weight,
    )


async def serve(config: RouterConfig, port_file: str | None = None) -> None:
    """Serve until SIGTERM: live at once, ready (omni.v1.Omni) once every stage has a replica."""
    handle, router = await create_server(config)
    health = lag = None
    await handle.set_serving(False, services=(SERVICE,))  # not ready until every stage has a replica

    def started() -> None:
        nonlocal health, lag
        write_port_file(port_file, handle.port)
        health = asyncio.get_running_loop().create_task(router.keep_health(handle))
        lag = asyncio.get_running_loop().create_task(loop_lag.watch(router.metrics.loop_lag))

    # NOTE: readiness (omni.v1.Omni) is keep_health's alone: marked SERVING with the rest at the
    # start, it read SERVING until keep_health's first round, with no stage replica maybe up.
    await serve_until_signal(handle, config.serving.grace_s, drain_delay_s=config.serving.drain_delay_s,
                             on_started=started, started_services=("",),
                             light_load_cpus=config.serving.light_load_cpus)
    for task in (health, lag):
        if task is not None:
            task.cancel()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    return run_cli(lambda: run_process("router", serve, config_from_args(args), args.port_file))


if __name__ == "__main__":
    sys.exit(main())
