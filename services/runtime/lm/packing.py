"""Prompts laid end to end for one prefill forward (admission in one step, services/runtime/lm/engine.py).

NOTE: why pack. On a GPU a prefill of a short prompt is thousands of small kernels and a dozen host
syncs whatever its length (about 3,200 ops for a 25-token thinker prompt at the full-size layout),
so a burst admitted one prompt a step waits for one such prefill each: the 32nd of 64 requests
waited ~5 s on an H200. Packed, every waiting prompt goes through each layer once: one GEMM per
weight over all their tokens, one MoE call, attention block-diagonal (each prompt's tokens see their
own prompt's, causally), their keys and values scattered into their slots after. The rows of a
packed forward are not bit-identical to each prompt alone (the GEMMs see other shapes), so exact
mode never packs (it prefills each prompt alone, several in a step).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from types import SimpleNamespace
from typing import Any

import torch

from services.runtime.lm.prefix.keys import PromptPrefix


@dataclass(frozen=True)
class PackedPrompt:
    """A whole prompt of a packed prefill (SlotScheduledEngine.prefill_packed): whose, its slot, the
    engine's inputs for it, and what its slot and the prefix pool take of it."""

    request_id: str
    slot: int
    state: Any  # the engine's per-request state
    inputs: Any  # the engine's inputs of its forward, laid end to end with the others' (`packed_forward`)
    tokens: int  # its length P
    positions: torch.Tensor | None  # [rows, 1, P] its position ids (None: the engine counts them from the cache)
    keys: list[bytes]  # its whole blocks' pool keys ([]: not kept)
    extras: bool = False  # the pool keeps its extra hidden layers too (the thinker's, for the talker)
    publish: PromptPrefix | None = None  # its message prefixes, told to the router once kept


@dataclass(frozen=True)
class Packing:
    """Where each prompt sits in the packed sequence."""

    lengths: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def spans(self) -> list[slice]:
        """Each prompt's positions in the packed sequence."""
        return [slice(end - length, end) for end, length in zip(accumulate(self.lengths), self.lengths)]

    def mask(self, device) -> torch.Tensor:
        """[1, 1, T, T] bool, True where a query may attend: its own prompt's keys up to itself."""
        prompt = torch.repeat_interleave(torch.arange(len(self.lengths)), torch.tensor(self.lengths)).to(device)
        position = torch.arange(self.total, device=device)
        same = prompt.unsqueeze(1) == prompt.unsqueeze(0)
        causal = position.unsqueeze(1) >= position.unsqueeze(0)
        return (same & causal)[None, None]


class CacheRows:
    """One prompt's positions of a packed forward's cache, read as a batch-1 cache of its own (what
    SlotKVCache.load and PrefixPool.store read: `layers[i].keys`, `.values`, `get_seq_length()`)."""

    def __init__(self, cache, span: slice):
        self.layers = [SimpleNamespace(keys=layer.keys[:, :, span], values=layer.values[:, :, span])
                       for layer in cache.layers]
        self.length = span.stop - span.start

    def get_seq_length(self) -> int:
        return self.length
