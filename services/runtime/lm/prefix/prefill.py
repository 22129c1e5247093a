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
    """A prompt's forward into a fresh cache, and what the pool keeps of it."""

    output: Any  # the model's output: logits [1, P, vocab], hidden states where asked
    cache: Any  # transformers' DynamicCache: every prompt position's keys and values
    finals: torch.Tensor | None = None  # [P, hidden] the LM head's input (the thinker keeps it per block)
    hidden: torch.Tensor | None = None  # [extra, P, hidden] the layers the talker reads (the thinker)


Forward = Callable[[Any, PrefixHit], PromptForward]  # (fresh cache, the hit) -> the forward's result


def usable_blocks(tokens: int) -> int:
    """The blocks a prompt of `tokens` may take from the pool: never its last token, whose row's
    logits the prefill must compute (a prompt re-sent whole still prefills its last block)."""
    return (tokens - 1) // BLOCK_TOKENS


def prefill(pool: PrefixPool | None, keys: list[bytes], tokens: int, stack: DecoderStack, forward: Forward, *,
            use_hits: bool, need_extras: bool = False, publish: PromptPrefix | None = None
            ) -> tuple[PromptForward, PrefixHit]:
    """`forward` of a prompt of `tokens` whose whole blocks have `keys`, from the blocks `pool` holds
    of it (`use_hits` False: looked up and counted, not used; no keys or no pool: a cold prefill),
    then its new whole blocks stored and, with `publish`, its message prefixes told to the router."""
    from transformers import DynamicCache

    cache = DynamicCache(config=stack.config)
    hit = pool.lookup(keys, usable_blocks(tokens), need_extras, use=use_hits) if pool is not None and keys \
        else PrefixHit()
    with from_cached_blocks(pool, hit, cache, stack):
        result = forward(cache, hit)
    if pool is not None and keys:
        pool.store(keys, result.cache, result.finals, result.hidden, first=len(hit.blocks))
        if publish is not None:
            pool.publish(publish, keys)
    return result, hit


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
def from_cached_blocks(pool: PrefixPool | None, hit: PrefixHit, cache, stack: DecoderStack):
    """Inside the block, a prompt's forward into `cache` (a fresh transformers Cache) computes only
    the positions after the hit's: their keys and values preloaded into `cache`, the decoder stack
    cut there (`skipping_prefix`), its attention the one a prefill after cached keys runs
    (kernels.attention_after_cached_keys). The hit's blocks stay pinned until the block ends.
    Without a hit, nothing changes."""
    if not hit.blocks:
        yield
        return
    try:
        pool.preload(hit, cache)
        with skipping_prefix(stack.module, hit.tokens), attention_after_cached_keys(stack.config, True):
            yield
    finally:
        pool.release(hit)
