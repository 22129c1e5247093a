"""The thinker's static-shape decode step for CUDA graphs (see services/runtime/lm/static_decode.py)."""

from __future__ import annotations

from collections.abc import Callable

from services.runtime.lm.kv_slots import SlotKVCache
from services.runtime.lm.static_decode import StaticSlotView


def thinker_step(model, cache: SlotKVCache) -> Callable:
    """(ids [B, 1], position_ids [4, B, 1], slots [B], positions [B], span [L]) -> logits [B, vocab]."""

    def step(ids, position_ids, slots, positions, span):
        view = StaticSlotView(cache, slots, positions, span)
        out = model(input_ids=ids, position_ids=position_ids, past_key_values=view, use_cache=True)
        return out.logits[:, -1]

    return step
