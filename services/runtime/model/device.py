"""A stage's device: what its timing reads there (services/base/timing.py's `ForwardTimer` takes it)
and how host data gets there without making the host wait."""

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


def to_device(values, dtype, device) -> torch.Tensor:
    """A host list as a device tensor without a blocking copy (`upload`)."""
    return upload(torch.tensor(values, dtype=dtype), device)


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on the device without a blocking copy: pinned and non-blocking on cuda (the copy
    is queued on the stream, the host goes on); elsewhere the same call, non-blocking (on the meta
    device, where tests count a step's copies, it reads as cuda's does)."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
