"""What a stage learns of the next stage's limits: each replica's, from its load report."""

from __future__ import annotations

import time

import grpc

from omni.v1 import common_pb2, stages_pb2_grpc
from services.serving.channels import ChannelPool
from services.serving.status import StageUnavailable


class PeerLimits:
    """The limits of each replica of the next stage, learnt from its load report and kept for
    `ttl_s` (a replica restarted with other flags is seen within that time)."""

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
            report = await stages_pb2_grpc.TalkerStub(self.channels.get(address)).GetLoad(
                common_pb2.LoadRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise StageUnavailable(self.stage, address, f"cannot read its limits: {exc.details() or exc.code().name}") from None
        if not report.HasField("limits"):
            raise StageUnavailable(self.stage, address, "its load report carries no limits")
        self._known[address] = (time.monotonic(), report.limits)
        return report.limits
