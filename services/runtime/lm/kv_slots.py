"""KV cache slots of an LM engine: one fixed-size buffer per layer for every slot, allocated at
start-up (`SlotKVCache`), and the view a batched decode step reads and writes (`BatchView`):
each row's keys and values over its own slot (`RowKV`, for the per-row attention of exact mode,
services/runtime/lm/kernels.py), or, where exact batching is off, the batch's rows over the
positions the longest of them uses, in one tensor (`SlotSpan`, one SDPA for the batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.runtime.lm.kernels import RowKV, SlotSpan
from services.runtime.model.device import to_device


class SlotKVCache:
    """Keys and values of up to `slots` requests, [slots, kv_heads, max_len, head_dim] per layer,
    allocated once. A request holds one slot from prefill to its end."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (slots, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * slots  # tokens stored per slot
        self.max_len = max_len
        self.batched_attention = False  # a decode batch attends in one call (exact batching off: the engine's set-up)

    @classmethod
    def for_config(cls, text_config, slots: int, max_len: int, dtype, device) -> SlotKVCache:
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        return cls(text_config.num_hidden_layers, slots, text_config.num_key_value_heads, max_len, head_dim,
                   dtype, device)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def load(self, slot: int, cache) -> None:
        """Copy a prefilled DynamicCache (batch 1) into `slot`."""
        length = cache.get_seq_length()
        if length > self.max_len:
            raise ValueError(f"prompt of {length} tokens exceeds the cache's {self.max_len}")
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            k[slot, :, :length] = cache.layers[layer].keys[0]
            v[slot, :, :length] = cache.layers[layer].values[0]
        self.lengths[slot] = length

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def wipe(self, slot: int) -> None:
        """Zero every position of `slot` (after non-finite values were written there: attention
        weighs a masked position by 0, and 0 x NaN is NaN, so a later request in this slot would
        read them at every position past its own)."""
        for k, v in zip(self.keys, self.values):
            k[slot].zero_()
            v[slot].zero_()
        self.lengths[slot] = 0

    def batch(self, slots: list[int]) -> BatchView:
        return BatchView(self, slots)


@dataclass
class BatchView:
    """Passed as `past_key_values` for one batched step over `slots` (row i -> slots[i])."""

    cache: SlotKVCache
    slots: list[int]

    def __post_init__(self):
        self.starts = [self.cache.lengths[s] for s in self.slots]  # lengths when the step began
        self.new_tokens = 0
        self._index = None  # (slots, starts) as index tensors, made once a step
        self._visible = None  # [B, T, L] the positions each query sees, for `SlotSpan` (batched attention)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs=None):
        # key_states: [B, kv_heads, T, head_dim] for this step's T new tokens per row.
        tokens = key_states.shape[2]
        self.new_tokens = tokens
        for slot, start in zip(self.slots, self.starts):
            if start + tokens > self.cache.max_len:
                raise ValueError(f"slot {slot} is full ({self.cache.max_len} tokens)")
        k_all, v_all = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        if tokens == 1 and len(self.slots) > 1:
            # Every row's one new position in two indexed copies (the same values as row-by-row writes).
            slots, starts = self._indices(k_all.device)
            k_all[slots, :, starts] = key_states[:, :, 0]
            v_all[slots, :, starts] = value_states[:, :, 0]
        else:
            for row, (slot, start) in enumerate(zip(self.slots, self.starts)):
                k_all[slot, :, start:start + tokens] = key_states[row]
                v_all[slot, :, start:start + tokens] = value_states[row]
        if self.cache.batched_attention and len(self.slots) > 1:
            return self._span(k_all, v_all, tokens)
        keys, values = RowKV(), RowKV()
        for slot, start in zip(self.slots, self.starts):
            keys.append(k_all[slot:slot + 1, :, :start + tokens])
            values.append(v_all[slot:slot + 1, :, :start + tokens])
        return keys, values

    def _indices(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, starts) as index tensors on the device, made once a step (every layer's the same)."""
        if self._index is None:
            self._index = tuple(to_device([self.slots, self.starts], torch.long, device))
        return self._index

    def _span(self, k_all: torch.Tensor, v_all: torch.Tensor, tokens: int) -> tuple[SlotSpan, SlotSpan]:
        """The batch's keys and values over the first L positions of each slot (L: the longest row's
        length after this step), each row's query t seeing its own positions up to start + t."""
        if self._visible is None:
            _, starts = self._indices(k_all.device)
            length = max(self.starts) + tokens
            ends = starts[:, None] + torch.arange(1, tokens + 1, device=k_all.device)  # [B, T]
            self._visible = torch.arange(length, device=k_all.device) < ends[:, :, None]  # [B, T, L]
        slots, length = self._index[0], self._visible.shape[-1]
        return (SlotSpan(k_all[:, :, :length].index_select(0, slots), self._visible),
                SlotSpan(v_all[:, :, :length].index_select(0, slots), self._visible))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.starts, default=0)

    def commit(self) -> None:
        """After the forward: the step's tokens are now part of each slot (the view can serve
        the next step of the same rows)."""
        self.starts = [start + self.new_tokens for start in self.starts]
        self._index = self._visible = None
        for slot, start in zip(self.slots, self.starts):
            self.cache.lengths[slot] = start


class SlotPositions:
    """Each slot's rope position ids of its last token, [slots, rows] on the device (rows: the
    model's position-id rows, 4 for Qwen3-Omni's thinker and talker). A decode step's position ids
    come from one gather and are advanced in place: three ops whatever the batch, no per-row tensors."""

    def __init__(self, slots: int, rows: int, device):
        self.table = torch.zeros((slots, rows), dtype=torch.long, device=device)

    def set(self, slot: int, last: torch.Tensor) -> None:
        """`slot` now holds a prompt whose last token had position ids `last` ([rows, 1, 1])."""
        self.table[slot] = last.reshape(-1)

    def advance(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [B] long on the device -> the next token's position ids [rows, B, 1] (each +1)."""
        step = self.table.index_select(0, slots) + 1
        self.table.index_copy_(0, slots, step)
        return step.t()[:, :, None]
