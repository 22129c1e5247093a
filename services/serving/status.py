"""The one place errors become gRPC statuses, with structured details (google.rpc, the gRPC
convention) beside the message people read.

- INVALID_ARGUMENT carries `google.rpc.BadRequest` with a field violation naming the field;
- RESOURCE_EXHAUSTED carries `google.rpc.RetryInfo` (when to try again);
- UNAVAILABLE of a stage carries `google.rpc.ErrorInfo` (reason STAGE_UNAVAILABLE, domain
  omni-serve, metadata `stage` and `replica`), so the router learns which replica failed from the
  details, never from the message text;
- everything else is INTERNAL with the exception's type and message.

The details travel in the `grpc-status-details-bin` trailer (grpcio-status); `error_info` and
`field_violations` read them back on the calling side.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.base.errors import ContextFull, InvalidArgument

DOMAIN = "omni-serve"
STAGE_UNAVAILABLE = "STAGE_UNAVAILABLE"  # ErrorInfo.reason: a stage could not be reached or died
STREAM_IDLE = "STREAM_IDLE"  # ErrorInfo.reason: a peer made no progress for the idle timeout
REPLAY_DIVERGED = "REPLAY_DIVERGED"  # ErrorInfo.reason: a replayed stage parted from what was delivered
CONTEXT_FULL = "CONTEXT_FULL"  # ErrorInfo.reason of an INVALID_ARGUMENT: the prompt does not fit (ContextFull)
_DETAILS_KEY = "grpc-status-details-bin"


class WireError(ValueError):
    """A tensor message that cannot be decoded (unknown dtype, size that does not match shape)."""


class StageUnavailable(Exception):
    """A stage could not be reached or died mid-stream (`replica` is its address, or a reason such
    as "no replica" when none was healthy)."""

    def __init__(self, stage: str, replica: str, detail: str):
        super().__init__(f"stage {stage} ({replica}) unavailable: {detail}")
        self.stage = stage
        self.replica = replica
        self.detail = detail


class StreamIdle(Exception):
    """A stream saw no event for its idle timeout (a stalled or vanished peer). `stage` (and
    `replica`, its address, when known) is the one that made no progress."""

    def __init__(self, stage: str, idle_timeout_s: float, replica: str = ""):
        where = f"{stage} ({replica})" if replica else stage
        super().__init__(f"{where}: no progress on this stream for {idle_timeout_s:g} s")
        self.stage = stage
        self.replica = replica


class ReplayDiverged(Exception):
    """After a move to another replica, the replay's repetition of what was already passed up
    differs from it (batching that is not bit-exact): splicing would be audible."""

    def __init__(self, stage: str, kind: str):
        super().__init__(f"stage {stage}: the replay after a replica failure parted from the {kind} already "
                         f"delivered (batching is not bit-exact: --exact-batching off?); ending the request "
                         f"rather than splicing")
        self.stage = stage
        self.kind = kind


@dataclass(frozen=True)
class Overloaded(Exception):
    """Admission refused the request: too many in flight and the queue is full or timed out."""

    message: str
    retry_after_s: float

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class EngineFailed(Exception):
    """The engine raised while serving this request (a bug or a resource failure, not the input)."""

    stage: str
    message: str

    def __str__(self) -> str:
        return f"{self.stage}: {self.message}"


def _pack(code: grpc.StatusCode, message: str, *details) -> status_pb2.Status:
    status = status_pb2.Status(code=code.value[0], message=message)
    for detail in details:
        status.details.add().Pack(detail)
    return status


def _error_info(reason: str, **metadata: str) -> error_details_pb2.ErrorInfo:
    return error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata)


def bad_request(field: str, description: str) -> error_details_pb2.BadRequest:
    return error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field=field, description=description)])


def status_for(exc: BaseException) -> tuple[status_pb2.Status, tuple]:
    """(google.rpc.Status, trailing metadata to pass through) for an error ending a call."""
    if isinstance(exc, InvalidArgument):
        full = (_error_info(CONTEXT_FULL),) if isinstance(exc, ContextFull) else ()
        return _pack(grpc.StatusCode.INVALID_ARGUMENT, str(exc), bad_request(exc.field, exc.description), *full), ()
    if isinstance(exc, WireError):
        return _pack(grpc.StatusCode.INVALID_ARGUMENT, f"malformed tensor: {exc}", bad_request("tensor", str(exc))), ()
    if isinstance(exc, StageUnavailable):
        return _pack(grpc.StatusCode.UNAVAILABLE, str(exc),
                     _error_info(STAGE_UNAVAILABLE, stage=exc.stage, replica=exc.replica)), ()
    if isinstance(exc, ReplayDiverged):
        return _pack(grpc.StatusCode.ABORTED, str(exc), _error_info(REPLAY_DIVERGED, stage=exc.stage, output=exc.kind)), ()
    if isinstance(exc, StreamIdle):
        where = {"stage": exc.stage, "replica": exc.replica} if exc.replica else {"stage": exc.stage}
        return _pack(grpc.StatusCode.UNAVAILABLE, str(exc), _error_info(STREAM_IDLE, **where)), ()
    if isinstance(exc, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(max(int(exc.retry_after_s * 1000), 1))
        return _pack(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), error_details_pb2.RetryInfo(retry_delay=delay)), ()
    if isinstance(exc, grpc.aio.AioRpcError):
        # A status another stage chose: pass it on, details included.
        passed = tuple((k, v) for k, v in exc.trailing_metadata() or () if k == _DETAILS_KEY)
        return status_pb2.Status(code=exc.code().value[0], message=exc.details() or exc.code().name), passed
    if isinstance(exc, EngineFailed):
        return _pack(grpc.StatusCode.INTERNAL, str(exc)), ()
    return _pack(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"), ()


async def abort_for(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status `exc` maps to (raises, as `context.abort` does)."""
    status, passed = status_for(exc)
    code = _CODES[status.code]
    if passed:
        await context.abort(code, status.message, trailing_metadata=passed)
    await context.abort(code, status.message, trailing_metadata=rpc_status.to_status(status).trailing_metadata)


_CODES = {code.value[0]: code for code in grpc.StatusCode}
assert _CODES[code_pb2.INVALID_ARGUMENT] is grpc.StatusCode.INVALID_ARGUMENT


def rpc_details(err: grpc.RpcError) -> status_pb2.Status | None:
    """The google.rpc.Status a failed call carried in its trailers, if any."""
    for key, value in err.trailing_metadata() or ():
        if key == _DETAILS_KEY:
            return status_pb2.Status.FromString(value)
    return None


def _unpacked(err: grpc.RpcError, kind):
    status = rpc_details(err)
    found = []
    for any_detail in status.details if status is not None else ():
        if any_detail.Is(kind.DESCRIPTOR):
            detail = kind()
            any_detail.Unpack(detail)
            found.append(detail)
    return found


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    infos = _unpacked(err, error_details_pb2.ErrorInfo)
    return infos[0] if infos else None


def field_violations(err: grpc.RpcError) -> list[tuple[str, str]]:
    """(field, description) of every BadRequest violation a failed call carried."""
    return [(v.field, v.description) for bad in _unpacked(err, error_details_pb2.BadRequest)
            for v in bad.field_violations]


def retry_after_s(err: grpc.RpcError) -> float | None:
    infos = _unpacked(err, error_details_pb2.RetryInfo)
    return infos[0].retry_delay.ToMilliseconds() / 1000 if infos else None


# What grpc aio reports locally when a write races the peer's end of the stream: the peer's own
# status is lost, so the stage ended (died or aborted) while we were sending to it.
_LOCAL_SEND_FAILED = "Internal error from Core"


def failure_of_call(stage: str, replica: str, err: grpc.aio.AioRpcError) -> Exception:
    """How a call to `stage` at `replica` ended, as the error to end our own call with.

    Connection-level failures (UNAVAILABLE without our ErrorInfo, or the local send race) name
    `stage`; statuses a stage chose itself pass through, and so does an UNAVAILABLE whose ErrorInfo
    already names a stage further down."""
    if err.code() is grpc.StatusCode.UNAVAILABLE and error_info(err) is None:
        return StageUnavailable(stage, replica, err.details() or err.code().name)
    if err.code() is grpc.StatusCode.INTERNAL and err.details() == _LOCAL_SEND_FAILED:
        return StageUnavailable(stage, replica, "the stream broke while sending to it")
    return err
