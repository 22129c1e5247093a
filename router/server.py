"""The router: the client-facing `omni.v1.Omni/Generate`.

Picks a replica of each stage for the request, puts that route in the call to the thinker, and
streams text deltas and audio chunks back to the client as they come. The client's deadline is
handed on to the thinker (which hands it on down the pipeline); a cancelled client call cancels
the thinker call, which cancels the talker and code2wav streams, freeing the work everywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import uuid
from dataclasses import dataclass

import grpc

from omni.v1 import omni_pb2, omni_pb2_grpc, stages_pb2, stages_pb2_grpc
from services.common.channels import ChannelPool
from services.common.config import env_default
from services.common.errors import UserError, run_cli
from services.common.grpc_server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ServerHandle,
    StageUnavailable,
    abort_for,
    build_server,
    serve_until_signal,
    setup_logging,
    time_remaining,
)
from services.common.service_main import write_port_file

log = logging.getLogger("router")
SERVICE = omni_pb2.DESCRIPTOR.services_by_name["Omni"].full_name


@dataclass(frozen=True)
class RouterConfig:
    thinker: tuple[str, ...]
    talker: tuple[str, ...]
    code2wav: tuple[str, ...]
    host: str = "0.0.0.0"
    port: int = 50051
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 30.0


class Replicas:
    """The replicas of each stage. For now: the first of each static list."""

    def __init__(self, config: RouterConfig):
        self.config = config

    def pick(self) -> tuple[str, stages_pb2.Route]:
        return self.config.thinker[0], stages_pb2.Route(talker=self.config.talker[0], code2wav=self.config.code2wav[0])


class OmniServicer(omni_pb2_grpc.OmniServicer):
    def __init__(self, config: RouterConfig):
        self.config = config
        self.replicas = Replicas(config)
        self.channels = ChannelPool(config.max_message_bytes)

    async def Generate(self, request: omni_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        thinker, route = self.replicas.pick()
        call = stages_pb2_grpc.ThinkerStub(self.channels.get(thinker)).Generate(
            stages_pb2.ThinkerRequest(request=request, route=route), timeout=time_remaining(context))
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as exc:
            await abort_for(context, StageUnavailable.from_rpc("thinker", thinker, exc))
        finally:
            call.cancel()  # no-op when finished; frees every stage when the client went away


async def create_server(config: RouterConfig) -> ServerHandle:
    handle = build_server(config.host, config.port, (SERVICE,), config.max_message_bytes)
    omni_pb2_grpc.add_OmniServicer_to_server(OmniServicer(config), handle.server)
    return handle


def _targets(value: str | None, flag: str) -> tuple[str, ...]:
    targets = tuple(t.strip() for t in (value or "").split(",") if t.strip())
    if not targets:
        raise UserError(f"{flag}: give at least one host:port")
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-router", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=env_default("host", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=env_default("port", 50051))
    parser.add_argument("--thinker", default=env_default("thinker", "localhost:50061"), help="host:port[,host:port]")
    parser.add_argument("--talker", default=env_default("talker", "localhost:50062"), help="host:port[,host:port]")
    parser.add_argument("--code2wav", default=env_default("code2wav", "localhost:50063"), help="host:port[,host:port]")
    parser.add_argument("--max-message-mb", type=int, default=env_default("max_message_mb", DEFAULT_MAX_MESSAGE_BYTES >> 20))
    parser.add_argument("--grace-s", type=float, default=env_default("grace_s", 30.0))
    parser.add_argument("--port-file")
    args = parser.parse_args(argv)

    def run() -> None:
        config = RouterConfig(
            thinker=_targets(args.thinker, "--thinker"), talker=_targets(args.talker, "--talker"),
            code2wav=_targets(args.code2wav, "--code2wav"), host=args.host, port=args.port,
            max_message_bytes=args.max_message_mb << 20, grace_s=args.grace_s,
        )
        setup_logging("router")

        async def serve() -> None:
            handle = await create_server(config)
            await serve_until_signal(handle, config.grace_s, on_started=lambda: write_port_file(args.port_file, handle.port))

        asyncio.run(serve())

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
