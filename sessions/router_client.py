"""A session's turns as ordinary `Omni/Generate` calls to the router, over gRPC.

Each turn is admitted by the router on its own and prefix-routed like any request, so an idle
session holds no place there. The turns go round the `--router` targets, one each; a call that
fails UNAVAILABLE before any output (its router replica drained or died) is sent once more, to the
next target (the same one when there is one: a restarted router on its address, or another pod of
a headless Service behind it). A turn that fails again, or fails once it has output, is that turn
failing alone (`TurnFailed`): the session goes on.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import grpc

from omni.v1 import omni_pb2, omni_pb2_grpc
from services.serving.channels import RotatingChannels
from services.serving.security import TLSConfig
from services.serving.status import CONTEXT_FULL, error_info, field_violations
from sessions.metrics import SessionMetrics

log = logging.getLogger("sessions")
# Every call goes round robin over the addresses its target resolves to: every ready router pod for
# a headless Service (dns:///omni-router-headless:50051), as the gateway's calls do.
ROUND_ROBIN = ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]}))


class TurnFailed(Exception):
    """A turn's router call ended with a status other than OK."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing_metadata=()):
        super().__init__(message)
        self._code, self._metadata = code, tuple(trailing_metadata or ())

    @classmethod
    def of(cls, err: grpc.aio.AioRpcError) -> TurnFailed:
        return cls(err.code(), err.details() or err.code().name, err.trailing_metadata())

    def code(self) -> grpc.StatusCode:
        return self._code

    def trailing_metadata(self):
        return self._metadata

    @property
    def context_full(self) -> bool:
        """The turn's prompt did not fit a stage's per-request cache (`ContextFull`): a shorter
        history would."""
        info = error_info(self)
        return self._code is grpc.StatusCode.INVALID_ARGUMENT and info is not None and info.reason == CONTEXT_FULL

    def as_error(self) -> omni_pb2.SessionError:
        """The session's error event: the status's name, its message, the field an INVALID_ARGUMENT names."""
        violations = field_violations(self)
        return omni_pb2.SessionError(code=self._code.name.lower(), message=str(self),
                                     field=violations[0][0] if violations else "")


@dataclass
class Turn:
    """What a turn's call carries besides its request: the session caller's bearer token (the
    router checks it as it checks any caller's) and the session's deadline, if it has one."""

    metadata: tuple[tuple[str, str], ...] = ()
    timeout_s: float | None = None


class RouterClient:
    def __init__(self, targets: tuple[str, ...], tls: TLSConfig, options: list, metrics: SessionMetrics):
        self.targets = targets
        self.channels = RotatingChannels(tls, list(options) + [ROUND_ROBIN])
        self.metrics = metrics
        self.next = 0  # the target of the next turn

    async def close(self) -> None:
        await self.channels.close()

    async def takes_tools(self, turn: Turn) -> bool | None:
        """Whether the pipeline takes requests with tools (Omni/GetModelInfo of the next router);
        None: not known (no thinker reported yet, or the router did not answer within 2 s)."""
        target = self.targets[self.next]
        try:
            info = await omni_pb2_grpc.OmniStub(self.channels.get(target)).GetModelInfo(
                omni_pb2.ModelInfoRequest(), metadata=turn.metadata or None, timeout=2.0)
        except grpc.aio.AioRpcError as err:
            log.warning("router %s did not say whether it takes tools (%s)", target, err.code().name)
            return None
        return info.tools if info.HasField("tools") else None

    async def generate(self, request: omni_pb2.GenerateRequest, turn: Turn):
        """The router's responses to `request`, to the Final; TurnFailed when the call fails."""
        first, self.next = self.next, (self.next + 1) % len(self.targets)
        for attempt in range(2):
            target = self.targets[(first + attempt) % len(self.targets)]
            if attempt:
                # A router restarted on its address: give the channel its reconnect backoff (at most
                # ~1.5 s) rather than fail at once on a channel still in TRANSIENT_FAILURE.
                await self.channels.wait_ready(target)
            call = omni_pb2_grpc.OmniStub(self.channels.get(target)).Generate(
                request, metadata=turn.metadata or None, timeout=turn.timeout_s)
            answered = False
            try:
                async for response in call:
                    answered = True
                    yield response
                return
            except grpc.aio.AioRpcError as err:
                if err.code() is grpc.StatusCode.UNAVAILABLE and not answered and attempt == 0:
                    log.warning("turn %s: router %s unavailable (%s); sending it again to %s", request.request_id,
                                target, err.details(), self.targets[(first + 1) % len(self.targets)])
                    self.metrics.turn_retries.inc()
                    continue
                raise TurnFailed.of(err) from None
            finally:
                call.cancel()  # no-op once finished; a cancelled turn (barge-in) frees every stage
