"""The prefix cache of the thinker (and of Qwen3-Omni's talker): the KV of prompt blocks computed
before, kept across requests, so a conversation's turn prefills only what its history does not
already hold.

A prompt is cut into blocks of BLOCK_TOKENS tokens. Block b's key is a hash chain: the previous
block's key, the block's token ids and the media digests of the messages that start in it
(services/serving/prefix_keys.py), so the same text with another image, or the same block after
another history, is another key. A block holds every layer's keys and values of its tokens, the
final hidden states (what the LM head reads: a hit's LM head runs over the whole prompt's rows,
the cached ones from here, so its call is the cold one's), and, when the request that made it fed
the talker, the hidden states the talker's inputs are read from (`extra layers`: the layer-0
inputs and the family's other layer), so a talker-fed request that hits gets the same `Prefilled`
as without the cache.

The pool is allocated once (`--prefix-cache-mb`): a fixed number of blocks. Blocks a running
prefill uses are pinned; a full pool evicts the least recently used unpinned block, the last
blocks of a chain first (a chain's blocks are touched last to first), and a pool whose blocks
are all pinned stores nothing more: a request never fails for the cache. Blocks are written only
once their prefill finished, on the engine's thread, so an aborted prefill leaves nothing behind,
and only prompt blocks are kept (a generated token's KV comes from a decode step, whose bits are
not a prefill's).

`PrefixIndex` is what the router sees (services/serving/prefix_keys.py, router/prefix.py): the
message-prefix keys whose blocks are held, with their token counts, as a log of changes since a
sequence number.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from services.runtime.lm.kernels import attention_after_cached_keys

BLOCK_TOKENS = 16
_KEY_BYTES = 16


@dataclass(frozen=True)
class PromptPrefix:
    """What the cache keys of a prompt use of its messages: where each message starts in the
    prompt's tokens (then where the generation prompt starts), each message's media digest (None:
    no media) and each message-prefix key (services/serving/prefix_keys.py)."""

    starts: tuple[int, ...]  # len(messages) + 1
    media: tuple[bytes | None, ...]  # len(messages)
    keys: tuple[bytes, ...]  # len(messages)

    @property
    def media_at(self) -> dict[int, bytes]:
        """Token index of a message's start -> its media digest, for the messages with media."""
        return {start: digest for start, digest in zip(self.starts, self.media) if digest is not None}


def block_keys(input_ids: list[int], media_at: dict[int, bytes]) -> list[bytes]:
    """The key of every whole block of a prompt (`media_at`: token index of a message's start ->
    that message's media digest)."""
    keys, key = [], b"omni-blocks-v1"
    for start in range(0, len(input_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        h = hashlib.blake2b(key, digest_size=_KEY_BYTES)
        h.update(b"".join(t.to_bytes(4, "little") for t in input_ids[start:start + BLOCK_TOKENS]))
        for i in range(start, start + BLOCK_TOKENS):
            if i in media_at:
                h.update(i.to_bytes(4, "little") + media_at[i])
        key = h.digest()
        keys.append(key)
    return keys


def row_block_keys(ids: list[int], rows: torch.Tensor) -> list[bytes]:
    """The key of every whole block of a prompt given as input rows ([P, hidden], the talker's:
    projected from the thinker's hidden states) with their token ids: a hash chain over both, so
    the same rows after the same rows are the same block, bit for bit."""
    data = rows.detach().to("cpu").contiguous().view(torch.uint8)  # [P, hidden * element size]
    keys, key = [], b"omni-rows-v1"
    for start in range(0, len(ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        h = hashlib.blake2b(key, digest_size=_KEY_BYTES)
        h.update(b"".join(t.to_bytes(4, "little") for t in ids[start:start + BLOCK_TOKENS]))
        h.update(data[start:start + BLOCK_TOKENS].numpy().tobytes())
        key = h.digest()
        keys.append(key)
    return keys


@dataclass
class _Block:
    key: bytes
    slot: int  # its place in the pool
    extras: bool  # holds the hidden states of the extra layers
    pins: int = 0  # running prefills that use it


@dataclass
class PrefixStats:
    """Counters since start (omni_prefix_cache_*)."""

    lookup_tokens: int = 0  # prompt tokens a lookup could have found
    hit_tokens: int = 0  # of those, found
    evictions: int = 0
    refused_tokens: int = 0  # found but not used: exact mode's probe refused hits


@dataclass
class PrefixHit:
    """The blocks a prefill starts from (pinned until `PrefixCache.release`)."""

    blocks: list[_Block] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.blocks) * BLOCK_TOKENS


class PrefixCache:
    """A fixed pool of prompt blocks: keys and values [blocks, layers, kv_heads, BLOCK, head_dim],
    the final hidden states [blocks, BLOCK, hidden], the extra layers' [blocks, extra, BLOCK, hidden]."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, hidden: int, extra_layers: int, dtype,
                 device, capacity_blocks: int, holds: bool = True):
        if capacity_blocks < 1:
            raise ValueError(f"a prefix cache needs at least one block, got {capacity_blocks}")
        rows = capacity_blocks if holds else 0  # holds False: the bookkeeping alone (`ledger`)
        shape = (rows, layers, kv_heads, BLOCK_TOKENS, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.extras = torch.empty((rows, extra_layers, BLOCK_TOKENS, hidden), dtype=dtype, device=device)
        self.finals = torch.empty((rows, BLOCK_TOKENS, hidden), dtype=dtype, device=device)
        self.holds = holds
        self.layers = layers
        self.capacity = capacity_blocks
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self.stats = PrefixStats()
        self.index = PrefixIndex()

    @classmethod
    def for_model(cls, text_config, megabytes: int, extra_layers: int, dtype, device, holds: bool = True) -> PrefixCache:
        """A pool of `megabytes` (at least one block) for an LM with this text config (`holds`
        False: its `ledger`, the bookkeeping without the tensors)."""
        dims = dict(layers=int(text_config.num_hidden_layers), kv_heads=int(text_config.num_key_value_heads),
                    head_dim=int(getattr(text_config, "head_dim", None)
                                 or text_config.hidden_size // text_config.num_attention_heads),
                    hidden=int(text_config.hidden_size), extra_layers=extra_layers, dtype=dtype)
        blocks = megabytes * (1 << 20) // cls.block_bytes(**dims)
        return cls(**dims, device=device, capacity_blocks=max(1, blocks), holds=holds)

    def empty_like(self, capacity_blocks: int, holds: bool = True) -> PrefixCache:
        """Another pool of the same layout and `capacity_blocks` blocks, nothing held."""
        return PrefixCache(layers=self.layers, kv_heads=self.keys.shape[2], head_dim=self.keys.shape[-1],
                           hidden=self.extras.shape[-1], extra_layers=self.extras.shape[1], dtype=self.keys.dtype,
                           device=self.keys.device, capacity_blocks=capacity_blocks, holds=holds)

    def keep_no_tensors(self) -> None:
        """Become this pool's `ledger` in place (exact mode's check refused hits): the tensors go, the
        bookkeeping stays, and the router is told of nothing more."""
        self.holds = False
        self.keys, self.values, self.extras, self.finals = (t.new_empty((0, *t.shape[1:])) for t in (
            self.keys, self.values, self.extras, self.finals))

    def ledger(self) -> PrefixCache:
        """What an engine that refuses hits keeps instead of this pool: the same blocks' bookkeeping
        without their tensors. Lookups still count what a prefill would have found (refused_tokens,
        what a pool of this size would save where hits are used); a prefill copies nothing, and the
        router is told of nothing held (a refused hit is not worth routing to)."""
        return self.empty_like(self.capacity, holds=False)

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
                if self.holds:
                    self._write(slot, cache, finals, span)
                self._blocks[keys[b]] = block
            if hidden is not None and not block.extras:
                if self.holds:
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

    def held(self, prefix: PromptPrefix, keys: list[bytes]) -> None:
        """After `store`: each message prefix whose whole blocks are all held goes in the index."""
        if not self.holds:
            return
        for j, message_key in enumerate(prefix.keys):
            blocks = min(prefix.starts[j + 1] // BLOCK_TOKENS, len(keys))
            if blocks and all(k in self._blocks for k in keys[:blocks]):
                self.index.held(message_key, keys[blocks - 1], blocks * BLOCK_TOKENS)

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


class PrefixIndex:
    """The message-prefix keys whose blocks the cache holds, for the router: key -> tokens held.
    A key is held while the last block it needs is; changes are logged with a sequence number, so
    a poll gets what changed since its last one (`report`). Read from the gRPC thread, written from
    the engine's: one lock."""

    def __init__(self, log_size: int = 8192):
        self.epoch = random.getrandbits(63) or 1  # a new one each start: the router's view resets
        self._lock = threading.Lock()
        self._seq = 0
        self._held: dict[bytes, int] = {}  # message key -> tokens held
        self._by_block: dict[bytes, set[bytes]] = {}  # block key -> the message keys it ends
        self._log: deque[tuple[int, bytes, int]] = deque(maxlen=log_size)  # (seq, key, tokens; 0: gone)

    def held(self, message_key: bytes, last_block: bytes, tokens: int) -> None:
        with self._lock:
            if self._held.get(message_key) == tokens:
                return
            self._held[message_key] = tokens
            self._by_block.setdefault(last_block, set()).add(message_key)
            self._append(message_key, tokens)

    def evicted(self, block_key: bytes) -> None:
        with self._lock:
            for message_key in self._by_block.pop(block_key, ()):
                if self._held.pop(message_key, None) is not None:
                    self._append(message_key, 0)

    def _append(self, key: bytes, tokens: int) -> None:
        self._seq += 1
        self._log.append((self._seq, key, tokens))

    def report(self, epoch: int, since: int) -> tuple[int, int, bool, list[tuple[bytes, int]]]:
        """(epoch, seq, full, changes): what changed after `since` (tokens 0: no longer held), or,
        when the caller's epoch is not this one or the log no longer reaches back to `since`,
        everything held (`full`)."""
        with self._lock:
            reaches = since >= (self._log[0][0] - 1 if self._log else self._seq)
            if epoch == self.epoch and reaches:
                return self.epoch, self._seq, False, [(k, t) for s, k, t in self._log if s > since]
            return self.epoch, self._seq, True, list(self._held.items())


@contextlib.contextmanager
def skipping_prefix(text_model, tokens: int):
    """Inside the block, `text_model`'s forward (the thinker's decoder stack) runs only the positions
    from `tokens` on: the thinker's own forward builds the whole prompt's inputs (embeddings, every
    media encoder's features, positions) as without the cache, and a pre-hook cuts them at the
    cached prefix, whose keys and values the cache passed in already holds."""
    if not tokens:
        yield
        return

    def cut(_module, args, kwargs):
        kwargs = dict(kwargs)
        for name in ("inputs_embeds",):
            kwargs[name] = kwargs[name][:, tokens:]
        positions = kwargs.get("position_ids")
        if positions is not None:
            kwargs["position_ids"] = positions[..., tokens:]
        if kwargs.get("cache_position") is not None:
            kwargs["cache_position"] = kwargs["cache_position"][tokens:]
        visual = kwargs.get("visual_pos_masks")
        if visual is not None:
            before = int(visual[:, :tokens].sum())
            kwargs["visual_pos_masks"] = visual[:, tokens:]
            if kwargs.get("deepstack_visual_embeds") is not None:
                kwargs["deepstack_visual_embeds"] = [e[before:] for e in kwargs["deepstack_visual_embeds"]]
        return args, kwargs

    with forward_pre_hook(text_model, cut, with_kwargs=True):
        yield


@contextlib.contextmanager
def forward_pre_hook(module, hook, with_kwargs: bool = False):
    """`hook` as `module`'s forward pre-hook inside the block, for the forwards of this thread only:
    exact mode's start-up check runs prefills through the same modules beside the engine's
    (services/runtime/checks.py)."""
    owner = threading.get_ident()

    def on_this_thread(*args):
        return hook(*args) if threading.get_ident() == owner else None

    handle = module.register_forward_pre_hook(on_this_thread, with_kwargs=with_kwargs)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def prefilling_after(prefix: PrefixCache | None, hit: PrefixHit, cache, text_model, text_config):
    """Inside the block, a prompt's forward into `cache` (a fresh transformers Cache) computes only
    the positions after the hit's: their keys and values preloaded into `cache`, `text_model`'s
    decoder stack cut there (`skipping_prefix`), its attention the one a prefill after cached keys
    runs (batching.attention_after_cached_keys). The hit's blocks stay pinned until the block ends.
    Without a hit, nothing changes."""
    if not hit.blocks:
        yield
        return
    try:
        prefix.preload(hit, cache)
        with skipping_prefix(text_model, hit.tokens), attention_after_cached_keys(text_config, True):
            yield
    finally:
        prefix.release(hit)
