"""What a stage learns of the next stage's limits: each replica's, from its load report."""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc

from omni.v1 import common_pb2
from services.base.stages import Stage
from services.serving.channels import ChannelPool
from services.serving.stage_stubs import stage_stub
from services.serving.status import StageUnavailable


class PeerLimits:
    """The limits of each replica of the next stage, learnt from its load report and kept for
    `ttl_s` (a replica restarted with other flags is seen within that time).

    The read waits for the channel to be ready (within `timeout_s`): the router routes to a
    replica as soon as its own health check sees it again, while this stage's channel to the
    same address may still sit in its reconnect backoff (up to a second, grpc_server's
    channel_options), and a plain call on such a channel fails at once."""

    def __init__(self, stage: str, channels: ChannelPool, ttl_s: float = 30.0, timeout_s: float = 2.0):
        self.stage = stage
        self.channels = channels
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._known: dict[str, tuple[float, common_pb2.StageLimits]] = {}  # address -> (fetched at, limits)

    async def get(self, address: str) -> common_pb2.StageLimits:
        known = self._known.get(address)
        if known is not None and time.monotonic() - known[0] < self.ttl_s:
            return known[1]
        try:
            report = await stage_stub(Stage.TALKER, self.channels.get(address)).GetLoad(
                common_pb2.LoadRequest(), timeout=self.timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            raise StageUnavailable(self.stage, address, f"cannot read its limits: {exc.details() or exc.code().name}") from None
        if not report.HasField("limits"):
            raise StageUnavailable(self.stage, address, "its load report carries no limits")
        self._known[address] = (time.monotonic(), report.limits)
        return report.limits

    async def first_of(self, addresses: Sequence[str]) -> common_pb2.StageLimits:
        """The limits of the first replica in `addresses` (the route's primary, then its
        fallbacks) that answers: a request whose primary died before it started still starts,
        and its stream moves to the fallback as it would mid-stream. Raises the primary's
        failure when none answers."""
        first_failure = None
        for address in addresses:
            try:
                return await self.get(address)
            except StageUnavailable as exc:
                first_failure = first_failure or exc
        raise first_failure
