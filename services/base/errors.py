"""User-facing errors: one line, naming what is wrong, non-zero exit; no tracebacks for mistakes."""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """A mistake in what the user asked for (a missing folder, an unknown voice, bad bytes)."""


class InvalidArgument(UserError):
    """A request field is invalid; `field` names it (maps to gRPC INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message


class ContextFull(InvalidArgument):
    """A prompt and its max_new_tokens do not fit a stage's per-request cache: nothing else is wrong,
    and a shorter history would fit (a realtime session drops its oldest turns and sends it again)."""


def run_cli(fn: Callable[[], None]) -> int:
    try:
        fn()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
