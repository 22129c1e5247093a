"""KV cache slots of an LM engine: one fixed-size buffer per layer for every slot, allocated at
start-up (`SlotKVCache`), and the view a batched decode step reads and writes (`BatchView`):
each row's keys and values over its own slot (`RowKV`, for the per-row attention of exact mode,
services/runtime/lm/kernels.py), or, where exact batching is off, the batch's rows over the
positions the longest of them uses, in one tensor (`SlotSpan`, one SDPA for the batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.runtime.lm.kernels import RowKV, SlotSpan


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
            self._index = (torch.tensor(self.slots, device=device), torch.tensor(self.starts, device=device))
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
