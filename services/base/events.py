"""The base of every event an engine step returns for a request.

Each engine's events are a closed set of frozen dataclasses deriving from `EngineEvent` (the
thinker's `Prefilled | Token | Finished`, the talker's `Frame | TalkerDone`, code2wav's
`Audio | Decoded`); a `final` event is the request's last, after which the engine holds nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class EngineEvent:
    final: ClassVar[bool] = False


@dataclass(frozen=True)
class RequestFailed(EngineEvent):
    """The engine could not serve this request: its own fault, or, with `field`, the input's (found
    only when the model ran: a media part its encoder refused). The other requests go on."""

    message: str
    field: str | None = None  # the request field at fault: INVALID_ARGUMENT naming it
    final: ClassVar[bool] = True
