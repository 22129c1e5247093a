"""What a stage's timing reads on its device (services/base/timing.py's `ForwardTimer` takes it)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def device_clock(device) -> Callable[[], torch.cuda.Event] | None:
    """Timing events on cuda (a forward's device time, read without a wait of its own); None
    elsewhere, where a forward's call returns when its work is done and the host clock times it."""
    if torch.device(device).type != "cuda":
        return None
    return functools.partial(torch.cuda.Event, enable_timing=True)
