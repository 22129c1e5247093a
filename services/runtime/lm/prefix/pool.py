"""The pool of prompt blocks: allocated once, pinned while a prefill reads them, least recently used
evicted (the package's docstring)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from services.runtime.lm.prefix.index import PrefixIndex
from services.runtime.lm.prefix.keys import BLOCK_TOKENS, PromptPrefix


@dataclass
class _Block:
    key: bytes
    slot: int  # its place in the pool
    extras: bool  # keeps the hidden states of the extra layers
    pins: int = 0  # running prefills that use it


@dataclass
class PrefixStats:
    """Counters since start (omni_prefix_cache_*)."""

    lookup_tokens: int = 0  # prompt tokens a lookup could have found
    hit_tokens: int = 0  # of those, found
    evictions: int = 0
    refused_tokens: int = 0  # found but not used: exact mode's check refused hits


@dataclass
class PrefixHit:
    """The blocks a prefill starts from (pinned until `PrefixPool.release`)."""

    blocks: list[_Block] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.blocks) * BLOCK_TOKENS


class PrefixPool:
    """A fixed pool of prompt blocks: keys and values [blocks, layers, kv_heads, BLOCK, head_dim],
    the final hidden states [blocks, BLOCK, hidden], the extra layers' [blocks, extra, BLOCK, hidden]."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, hidden: int, extra_layers: int, dtype,
                 device, capacity_blocks: int, keeps_tensors: bool = True):
        if capacity_blocks < 1:
            raise ValueError(f"a prefix cache needs at least one block, got {capacity_blocks}")
        rows = capacity_blocks if keeps_tensors else 0  # False: the bookkeeping alone (`ledger`)
        shape = (rows, layers, kv_heads, BLOCK_TOKENS, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.extras = torch.empty((rows, extra_layers, BLOCK_TOKENS, hidden), dtype=dtype, device=device)
        self.finals = torch.empty((rows, BLOCK_TOKENS, hidden), dtype=dtype, device=device)
        self.keeps_tensors = keeps_tensors
        self.layers = layers
        self.capacity = capacity_blocks
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self.stats = PrefixStats()
        self.index = PrefixIndex()

    @classmethod
    def for_model(cls, text_config, megabytes: int, extra_layers: int, dtype, device, keeps_tensors: bool = True) -> PrefixPool:
        """A pool of `megabytes` (at least one block) for an LM with this text config (`holds`
        False: its `ledger`, the bookkeeping without the tensors)."""
        dims = dict(layers=int(text_config.num_hidden_layers), kv_heads=int(text_config.num_key_value_heads),
                    head_dim=int(getattr(text_config, "head_dim", None)
                                 or text_config.hidden_size // text_config.num_attention_heads),
                    hidden=int(text_config.hidden_size), extra_layers=extra_layers, dtype=dtype)
        blocks = megabytes * (1 << 20) // cls.block_bytes(**dims)
        return cls(**dims, device=device, capacity_blocks=max(1, blocks), keeps_tensors=keeps_tensors)

    def empty_like(self, capacity_blocks: int, keeps_tensors: bool = True) -> PrefixPool:
        """Another pool of the same layout and `capacity_blocks` blocks, nothing held."""
        return PrefixPool(layers=self.layers, kv_heads=self.keys.shape[2], head_dim=self.keys.shape[-1],
                           hidden=self.extras.shape[-1], extra_layers=self.extras.shape[1], dtype=self.keys.dtype,
                           device=self.keys.device, capacity_blocks=capacity_blocks, keeps_tensors=keeps_tensors)

    def drop_tensors(self) -> None:
        """Become this pool's `ledger` in place (exact mode's check refused hits): the tensors go, the
        bookkeeping stays, and the router is told of nothing more."""
        self.keeps_tensors = False
        self.keys, self.values, self.extras, self.finals = (t.new_empty((0, *t.shape[1:])) for t in (
            self.keys, self.values, self.extras, self.finals))

    def ledger(self) -> PrefixPool:
        """What an engine that refuses hits keeps instead of this pool: the same blocks' bookkeeping
        without their tensors. Lookups still count what a prefill would have found (refused_tokens,
        what a pool of this size would save where hits are used); a prefill copies nothing, and the
        router is told of nothing held (a refused hit is not worth routing to)."""
        return self.empty_like(self.capacity, keeps_tensors=False)

    @staticmethod
    def block_bytes(*, layers: int, kv_heads: int, head_dim: int, hidden: int, extra_layers: int, dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        return (2 * layers * kv_heads * head_dim + (extra_layers + 1) * hidden) * BLOCK_TOKENS * element

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    def lookup(self, keys: list[bytes], usable: int, need_extras: bool, use: bool = True) -> PrefixHit:
        """The longest chain of `keys` held (at most `usable` blocks; with `need_extras`, only blocks
        that hold the extra layers), pinned. Counts the lookup; `use` False (exact mode refusing
        hits) counts what was found as refused and returns no hit."""
        self.stats.lookup_tokens += min(len(keys), usable) * BLOCK_TOKENS
        hit = PrefixHit()
        for key in keys[:usable]:
            block = self._blocks.get(key)
            if block is None or (need_extras and not block.extras):
                break
            hit.blocks.append(block)
        for block in reversed(hit.blocks):  # the chain's first block most recent: its tail goes first
            self._blocks.move_to_end(block.key)
        if not use:
            self.stats.refused_tokens += hit.tokens
            return PrefixHit()
        for block in hit.blocks:
            block.pins += 1
        self.stats.hit_tokens += hit.tokens
        return hit

    def peek(self, keys: list[bytes], usable: int, need_extras: bool) -> int:
        """Blocks `lookup` would find, with nothing pinned, counted or refreshed."""
        found = 0
        for key in keys[:usable]:
            block = self._blocks.get(key)
            if block is None or (need_extras and not block.extras):
                break
            found += 1
        return found

    def release(self, hit: PrefixHit) -> None:
        for block in hit.blocks:
            block.pins -= 1

    def preload(self, hit: PrefixHit, cache) -> None:
        """Every layer's keys and values of the hit's tokens into `cache` (a transformers Cache)."""
        if not hit.blocks:
            return
        slots = torch.tensor([b.slot for b in hit.blocks], device=self.keys.device)
        keys, values = self.keys[slots], self.values[slots]  # [n, layers, kv, BLOCK, d]
        for layer in range(self.layers):
            k = keys[:, layer].permute(1, 0, 2, 3).reshape(1, keys.shape[2], -1, keys.shape[-1])  # [1, kv, n*BLOCK, d]
            v = values[:, layer].permute(1, 0, 2, 3).reshape(1, keys.shape[2], -1, keys.shape[-1])
            cache.update(k, v, layer)

    def hidden_of(self, hit: PrefixHit) -> torch.Tensor:
        """The hit's extra layers' hidden states: [extra, n*BLOCK, hidden]."""
        slots = torch.tensor([b.slot for b in hit.blocks], device=self.extras.device)
        extras = self.extras[slots]  # [n, extra, BLOCK, hidden]
        return extras.permute(1, 0, 2, 3).reshape(extras.shape[1], -1, extras.shape[-1])

    def finals_of(self, hit: PrefixHit) -> torch.Tensor:
        """The hit's final hidden states (the LM head's input): [n*BLOCK, hidden]."""
        slots = torch.tensor([b.slot for b in hit.blocks], device=self.finals.device)
        return self.finals[slots].reshape(-1, self.finals.shape[-1])

    def store(self, keys: list[bytes], cache, finals: torch.Tensor | None, hidden: torch.Tensor | None,
              first: int) -> None:
        """Blocks `first`.. of `keys` from a finished prefill: `cache` holds every layer's keys and
        values of the prompt, `finals` [P, hidden] its final hidden states (None: not kept), `hidden`
        [extra, P, hidden] the extra layers (None: not computed)."""
        stored = first
        for b in range(first, len(keys)):
            span = slice(b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS)
            block = self._blocks.get(keys[b])
            if block is None:
                slot = self._take_slot()
                if slot is None:
                    break  # every block pinned: nothing more is kept
                block = _Block(keys[b], slot, extras=False)
                if self.keeps_tensors:
                    self._write(slot, cache, finals, span)
                self._blocks[keys[b]] = block
            if hidden is not None and not block.extras:
                if self.keeps_tensors:
                    self.extras[block.slot] = hidden[:, span]
                block.extras = True
            stored = b + 1
        for key in reversed(keys[:stored]):  # the chain's first block the most recent: its tail goes first
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _write(self, slot: int, cache, finals: torch.Tensor | None, span: slice) -> None:
        """One block of a finished prefill into the pool: every layer's keys and values, its finals."""
        for layer in range(self.layers):
            layer_cache = cache.layers[layer]
            self.keys[slot, layer] = layer_cache.keys[0, :, span]
            self.values[slot, layer] = layer_cache.values[0, :, span]
        if finals is not None:
            self.finals[slot] = finals[span]

    def publish(self, prefix: PromptPrefix, keys: list[bytes]) -> None:
        """After `store`: each message prefix whose whole blocks are all held goes in the index."""
        if not self.keeps_tensors:
            return
        for j, message_key in enumerate(prefix.keys):
            blocks = min(prefix.starts[j + 1] // BLOCK_TOKENS, len(keys))
            if blocks and all(k in self._blocks for k in keys[:blocks]):
                self.index.add(message_key, keys[blocks - 1], blocks * BLOCK_TOKENS)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        victim = next((b for b in self._blocks.values() if not b.pins), None)
        if victim is None:
            return None
        del self._blocks[victim.key]
        self.stats.evictions += 1
        self.index.evicted(victim.key)
        return victim.slot


