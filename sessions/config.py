"""The sessions service's configuration: where the routers are, its bound on sessions, and its
bounds on each session (`SessionConfig`), from flags once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from services.base.errors import UserError
from services.serving.config import ServingConfig

DEFAULT_PORT = 50052


@dataclass(frozen=True)
class SessionConfig:
    """The service's bounds on each session (flags --session-*, --max-input-realtime)."""

    idle_timeout_s: float = 300.0  # no client message and no response this long: closed
    max_duration_s: float = 3600.0  # a session open this long is closed (a response in progress cancelled)
    max_turns: int = 200  # responses a session may create; the next closes it
    max_input_s: float = 60.0  # audio the input buffer may hold; an append past it is refused
    max_append_bytes: int = 1 << 20  # one append's bytes; a larger one is refused
    max_image_bytes: int = 8 << 20  # one image part of a user item; a larger one is refused
    send_timeout_s: float = 10.0  # one event the client takes no bytes of this long: closed (a slow reader)
    # Input audio faster than this many times real time is refused (0 = no bound), beyond a start of
    # `input_burst_s` seconds any client may send at once (a buffered microphone, a short recording).
    max_input_realtime: float = 2.0
    input_burst_s: float = 10.0
    # With turn detection's create_response: each turn's answer starts once its speech went quiet for
    # `early_response_after_ms` (rounded up to whole 32 ms windows: by default the first silent
    # window), held back until the silence setting confirms the turn (docs/sessions.md).
    early_response: bool = True
    early_response_after_ms: int = 32


@dataclass(frozen=True)
class SessionsConfig:
    # The routers every turn goes to: gRPC targets (host:port, or dns:///name:port for every address
    # a name resolves to, round robin); a turn whose router fails UNAVAILABLE is retried on the next.
    routers: tuple[str, ...] = ("localhost:50051",)
    # Where it listens, message limit, grace, metrics, TLS (client -> sessions and sessions -> router).
    serving: ServingConfig = ServingConfig(port=DEFAULT_PORT)
    session: SessionConfig = SessionConfig()
    max_sessions: int = 256  # open at once on this replica; the next is refused at connect
    retry_after_s: float = 1.0  # RetryInfo on a refused session
    auth_tokens: tuple[bytes, ...] = ()  # bearer tokens callers must present; empty = no authentication


def parse_routers(spec: str, flag: str = "--router") -> tuple[str, ...]:
    """`host:port[,host:port]` or `dns:///host:port` -> the targets, each checked."""
    targets = tuple(t.strip() for t in spec.split(",") if t.strip())
    if not targets or any(":" not in t for t in targets):
        raise UserError(f"{flag}: expected host:port[,host:port] or dns:///host:port, got {spec!r}")
    return targets
