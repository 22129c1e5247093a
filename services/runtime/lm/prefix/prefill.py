"""The one prefill of a prompt every LM engine runs (the thinker's and both families' talkers'):
lookup of its blocks in the pool, their keys and values preloaded and the decoder stack cut after
them, the forward, the new whole blocks stored, the message prefixes published for the router;
and the forward hooks it cuts the decoder stack with.

A hit computes the prompt's last rows only; why that is exact, and when exact mode uses it:
docs/architecture.md, "Prefix cache: when a hit is exact", and `check.py` here."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.runtime.lm.kernels import attention_after_cached_keys
from services.runtime.lm.prefix.keys import BLOCK_TOKENS, PromptPrefix
from services.runtime.lm.prefix.pool import PrefixHit, PrefixPool


@dataclass(frozen=True)
class DecoderStack:
    """What a prefill from cached blocks cuts: the decoder stack (`module`, whose forward pre-hook cuts
    the inputs the model built for the whole prompt) and its text config (the cache's layout and the
    attention implementation)."""

    module: Any
    config: Any


@dataclass
class PromptForward:
    """A prompt's forward (or a chunk's) into its cache, and what the pool keeps of it."""

    output: Any  # the model's output: logits [1, rows computed, vocab], hidden states where asked
    cache: Any  # transformers' DynamicCache: the keys and values of every prompt position so far
    finals: torch.Tensor | None = None  # [P, hidden] the LM head's input so far (the thinker keeps it per block)
    hidden: torch.Tensor | None = None  # [extra, P, hidden] the layers the talker reads so far (the thinker)


@dataclass(frozen=True)
class Prior:
    """The prompt positions before the rows a forward computes (a hit's cached blocks, or the chunks
    prefilled in earlier steps): how many, and the rows the forward completes its outputs with."""

    tokens: int = 0
    finals: torch.Tensor | None = None  # [tokens, hidden]: the LM head's input there, where kept
    hidden: torch.Tensor | None = None  # [extra, tokens, hidden]: the extra layers there, where kept


# The decoder stack's inputs over the whole prompt that a chunked prefill's first chunk keeps
# (`cutting`): later chunks take them instead of building them again (a long audio prompt's
# encoder ran once, not once a chunk).
STACK_INPUTS = ("inputs_embeds", "position_ids", "visual_pos_masks", "deepstack_visual_embeds")


@dataclass
class Partial:
    """A prompt prefilled a chunk a step: its cache and outputs so far (`PromptForward`), `done` tokens,
    and, where the engine keeps them, the decoder stack's whole-prompt inputs (`STACK_INPUTS`)."""

    done: int
    result: PromptForward
    inputs: dict | None = None

    @property
    def prior(self) -> Prior:
        return Prior(self.done, self.result.finals, self.result.hidden)


Forward = Callable[[Any, Prior], PromptForward]  # (the cache, what comes before the rows) -> the result


def usable_blocks(tokens: int) -> int:
    """The blocks a prompt of `tokens` may take from the pool: never its last token, whose row's
    logits the prefill must compute (a prompt re-sent whole still prefills its last block)."""
    return (tokens - 1) // BLOCK_TOKENS


def prefill(pool: PrefixPool | None, keys: list[bytes], tokens: int, stack: DecoderStack, forward: Forward, *,
            use_hits: bool, need_extras: bool = False, need_finals: bool = False, publish: PromptPrefix | None = None,
            partial: Partial | None = None, stop: int | None = None, stack_inputs: dict | None = None
            ) -> tuple[PromptForward, PrefixHit]:
    """`forward` of a prompt of `tokens` whose whole blocks have `keys`, from the blocks `pool` holds
    of it (`use_hits` False: looked up and counted, not used; no keys or no pool: a cold prefill),
    then its new whole blocks stored and, with `publish`, its message prefixes told to the router.
    `need_extras`, `need_finals`: the forward reads a hit's extra layers, its LM head input.
    A chunked prefill computes the prompt's positions up to `stop` only, after the `partial` one of
    earlier steps (its cache and outputs); the pool keeps the prompt once its last chunk is done.
    `stack_inputs` (a chunked prefill's, where the engine keeps them): empty, the forward fills it
    with the stack's whole-prompt inputs; filled, the stack takes them (`cutting`)."""
    from transformers import DynamicCache

    stop = tokens if stop is None else stop
    hit = PrefixHit()
    if partial is not None:
        cache, prior = partial.result.cache, partial.prior
    else:
        cache = DynamicCache(config=stack.config)
        if pool is not None and keys:
            # stop <= tokens: a first chunk takes no block past its own last token either
            hit = pool.lookup(keys, usable_blocks(stop), need_extras, use=use_hits)
        prior = Prior()
    with from_cached_blocks(pool, hit, cache, stack, prior.tokens or hit.tokens, stop, tokens, stack_inputs):
        if hit.blocks:
            prior = Prior(hit.tokens, pool.finals_of(hit) if need_finals else None,
                          pool.hidden_of(hit) if need_extras else None)
        result = forward(cache, prior)
    if pool is not None and keys and stop == tokens:
        pool.store(keys, result.cache, result.finals, result.hidden, first=len(hit.blocks))
        if publish is not None:
            pool.publish(publish, keys)
    return result, hit


def held(pool: PrefixPool | None, keys: list[bytes], tokens: int, need_extras: bool) -> bool:
    """Whether `pool` holds the first block of a prompt of `tokens` whose blocks have `keys` (a
    prefill of it would be a hit: the prompt is not packed), nothing pinned or counted."""
    return bool(keys) and pool.peek(keys, usable_blocks(tokens), need_extras) > 0


def keep_packed(pool: PrefixPool, keys: list[bytes], tokens: int, rows, result: PromptForward, span: slice, *,
                use_hits: bool, need_extras: bool, publish: PromptPrefix | None) -> None:
    """A packed prompt's blocks kept as `prefill` keeps a prompt's: the pool held none of it (`held`),
    so the lookup only counts the miss, and every whole block is stored. `rows`: its positions of the
    packed forward's cache (packing.CacheRows); `span`: its rows in the forward's `result`."""
    pool.lookup(keys, usable_blocks(tokens), need_extras, use=use_hits)
    pool.store(keys, rows, None if result.finals is None else result.finals[span],
               result.hidden[:, span] if need_extras else None, first=0)
    if publish is not None:
        pool.publish(publish, keys)


@contextlib.contextmanager
def cutting(stack_module, start: int, stop: int, tokens: int, inputs: dict | None = None):
    """Inside the block, the decoder stack's forward runs only the prompt positions [start, stop):
    the model's own forward builds the whole prompt's inputs (embeddings, every media encoder's
    features, positions) as for one prefill, and a pre-hook cuts them there; the cache passed in
    already holds the keys and values of the positions before `start`. With `inputs`, an empty
    dict keeps the whole prompt's (`STACK_INPUTS`) and a filled one replaces the forward's: a
    chunk after the first may then build none (its model forward given the token ids alone)."""
    if start == 0 and stop == tokens:
        yield
        return

    def cut(_module, args, kwargs):
        kwargs = dict(kwargs)
        if inputs:
            kwargs.update(inputs)
        elif inputs is not None:
            inputs.update({name: kwargs[name] for name in STACK_INPUTS if kwargs.get(name) is not None})
        kwargs["inputs_embeds"] = kwargs["inputs_embeds"][:, start:stop]
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.ndim == 2:  # [1, P]: over the cached and the computed positions
            kwargs["attention_mask"] = mask[:, :stop]
        positions = kwargs.get("position_ids")
        if positions is not None:
            kwargs["position_ids"] = positions[..., start:stop]
        if kwargs.get("cache_position") is not None:
            kwargs["cache_position"] = kwargs["cache_position"][start:stop]
        visual = kwargs.get("visual_pos_masks")
        if visual is not None:
            before, inside = int(visual[:, :start].sum()), int(visual[:, start:stop].sum())
            kwargs["visual_pos_masks"] = visual[:, start:stop]
            if kwargs.get("deepstack_visual_embeds") is not None:
                kwargs["deepstack_visual_embeds"] = [e[before:before + inside] for e in kwargs["deepstack_visual_embeds"]]
        return args, kwargs

    with forward_pre_hook(stack_module, cut, with_kwargs=True):
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
def from_cached_blocks(pool: PrefixPool | None, hit: PrefixHit, cache, stack: DecoderStack, start: int, stop: int,
                       tokens: int, stack_inputs: dict | None = None):
    """Inside the block, a prompt's forward into `cache` computes only its positions [start, stop):
    a hit's keys and values preloaded into `cache` (the cache of earlier chunks holds them already),
    the decoder stack cut there (`cutting`), its attention the one a prefill after cached keys runs
    (kernels.attention_after_cached_keys). The hit's blocks stay pinned until the block ends."""
    try:
        if hit.blocks:
            pool.preload(hit, cache)
        with cutting(stack.module, start, stop, tokens, stack_inputs), attention_after_cached_keys(stack.config, start > 0):
            yield
    finally:
        if hit.blocks:
            pool.release(hit)
