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
from types import SimpleNamespace

import torch


@dataclass(frozen=True)
class Packing:
    """Where each prompt sits in the packed sequence."""

    lengths: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def span(self, i: int) -> slice:
        start = sum(self.lengths[:i])
        return slice(start, start + self.lengths[i])

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
