"""Whether exact mode uses prefix-cache hits, and the start-up check of the mode that does: the same
policy and the same check for every LM stage (the thinker, both families' talkers).

A hit prefills only the rows after the cached blocks: every op of the decoder stack sees fewer
query rows than the cold prefill of the same prompt. With per-row kernels (--exact-batching on,
whose oracle is plain `generate`) that changes bits: the BLAS picks its blocking by the row count
(on the AMD EPYC host a 200-token prompt cut after 160 tokens differed in a linear layer), and
SDPA cuts its queries into blocks by their count (a 129-token prompt from 112 cached tokens
differed in its last row). So that mode refuses hits (ROWS_REFUSE), by construction, not by check.
With --exact-batching gemm every linear layer and expert goes through the invariant GEMM and the
attention through `invariant_attention` (services/runtime/lm/kernels.py): each output row's bits
are independent of the row count, and the thinker's LM head runs over the whole prompt's rows
either way, so a hit gives the cold prefill's bits by construction. That mode checks it beside
serving (services/runtime/checks.py: hits are refused until it passed) on a few prompts of the
engine's own (`prefix_case`: random text ids for the thinker, random input rows for a talker),
each prefilled cold and from cached blocks through the one prefill path (prefill.py), bitwise on
the last logits, every layer's keys and values and the hidden states the talker reads, so a
broken construction (another kernel in the path) refuses hits instead of changing outputs. It
prefills through the engine's model on its own thread, into a scratch pool; the prefill's hooks
act on their own thread's forwards only. Both outcomes are logged once and exported as
`omni_exact_kernel_info{op="prefix_hit"}`; refused lookups count as
`omni_prefix_cache_refused_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.runtime.lm.kernels import ExactKernels, using_kernels
from services.runtime.lm.prefix.keys import BLOCK_TOKENS
from services.runtime.lm.prefix.pool import PrefixPool
from services.runtime.lm.prefix.prefill import Forward, prefill

ROWS_REFUSE = ("per-row kernels (--exact-batching on): a prefill of fewer rows is not the cold one's bits by "
               "construction; --exact-batching gemm uses hits")

# (prompt tokens, cached blocks): short to conversation-long prompts, cuts early and late.
CASES = ((2 * BLOCK_TOKENS + 5, 1), (6 * BLOCK_TOKENS + 3, 4), (12 * BLOCK_TOKENS + 9, 11), (40 * BLOCK_TOKENS + 7, 33))


@dataclass
class PrefixCase:
    """One prompt of an engine's own for the check: its block keys, its length, and its forward
    reading cached blocks from a given pool."""

    keys: list[bytes]
    tokens: int
    forward: Callable[[PrefixPool], Forward]  # the pool a hit reads from -> the prompt's forward


def plain_token_ids(configs, vocab: int, n: int, seed: int) -> torch.Tensor:
    """[1, n] ids from the widest range of the vocabulary that holds none of `configs`' special ids
    (a media placeholder would ask for features)."""
    special = set()
    for config in configs:
        for name, value in vars(config or object()).items():
            if (name.endswith("_token_id") or name.endswith("_token_index")) and isinstance(value, int):
                special.add(value)
    bounds = [-1, *sorted(s for s in special if 0 <= s < vocab), vocab]
    low, high = max(zip(bounds, bounds[1:]), key=lambda pair: pair[1] - pair[0])
    return torch.randint(low + 1, high, (1, n), generator=torch.Generator().manual_seed(seed))


def refused_hits(engine, kernels: ExactKernels) -> str | None:
    """Exact mode: why `engine` refuses prefix-cache hits here, None when it uses them (the check's
    report, logged once, carries it)."""
    if not engine.engine_config.exact_gemm:
        return ROWS_REFUSE
    return hits_differ(engine, kernels)


@torch.inference_mode()
def hits_differ(engine, kernels: ExactKernels) -> str | None:
    """None if every case gave the same bits both ways, prefilled along `kernels` (the paths the
    check adopts); else why not."""
    scratch = engine.prefix_pool.empty_like(max(c for _, c in CASES))
    try:
        with using_kernels(kernels):  # the paths its steps run (the invariant GEMM with --exact-batching gemm)
            for tokens, cached_blocks in CASES:
                if why := _differs(engine, engine.prefix_case(tokens, seed=tokens), cached_blocks, scratch):
                    return why
    except Exception as exc:  # noqa: BLE001 - a check that cannot run means: not exact here
        return f"check failed: {type(exc).__name__}: {exc}"
    return None


def _differs(engine, case: PrefixCase, cached_blocks: int, scratch: PrefixPool) -> str | None:
    cold, _ = prefill(None, [], case.tokens, engine.stack, case.forward(scratch), use_hits=False)
    scratch.store(case.keys[:cached_blocks], cold.cache, cold.finals, cold.hidden, first=0)
    warm, hit = prefill(scratch, case.keys, case.tokens, engine.stack, case.forward(scratch), use_hits=True,
                        need_extras=cold.hidden is not None, need_finals=cold.finals is not None)
    where = f"a {case.tokens}-token prompt from {hit.tokens} cached tokens"
    if len(hit.blocks) < cached_blocks:
        return f"{where}: {cached_blocks} blocks were stored, {len(hit.blocks)} found"
    if not torch.equal(cold.output.logits[0, -1], warm.output.logits[0, -1]):
        return f"{where}: the last logits differ"
    for layer, (a, b) in enumerate(zip(cold.cache.layers, warm.cache.layers)):
        if not (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)):
            return f"{where}: layer {layer}'s keys or values differ"
    if cold.hidden is not None and not torch.equal(cold.hidden, warm.hidden):
        return f"{where}: the hidden states the talker reads differ"
    return None
