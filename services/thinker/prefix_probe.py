"""Whether exact mode uses prefix-cache hits, and the start-up check of the mode that does.

A hit prefills only the rows after the cached blocks: every op of the decoder stack sees fewer
query rows than the cold prefill of the same prompt. With per-row kernels (--exact-batching on,
whose oracle is plain `generate`) that changes bits: the BLAS picks its blocking by the row count
(on the AMD EPYC host a 200-token prompt cut after 160 tokens differed in a linear layer), and
SDPA cuts its queries into blocks by their count (a 129-token prompt from 112 cached tokens
differed in its last row). So that mode refuses hits (ROWS_REFUSE), by construction, not by probe.
With --exact-batching gemm every linear layer and expert goes through the invariant GEMM and the
thinker's attention through `invariant_attention` (services/runtime/lm/kernels.py): each output
row's bits are independent of the row count, and the LM head runs over the whole prompt's rows
either way, so a hit gives the cold prefill's bits by construction. That mode checks it once at
start, beside serving (services/runtime/checks.py: hits are refused until it passed), on a
few text prompts of its own (bitwise: the last logits, every layer's keys and values, the hidden
states the talker reads), so a broken construction (another kernel in the path) refuses hits
instead of changing outputs. It prefills through the engine's model on its own thread, into a
scratch pool of its own; the prefill's hooks act on their own thread's forwards only. Both outcomes
are logged once and exported as `omni_exact_kernel_info{op="prefix_hit"}`; refused lookups count
as `omni_prefix_cache_refused_tokens`.
"""

from __future__ import annotations

import torch

from services.base.timing import ForwardTimer
from services.runtime.lm.kernels import ExactKernels, using_kernels
from services.runtime.lm.prefix_cache import BLOCK_TOKENS, PrefixCache, PrefixHit, block_keys

ROWS_REFUSE = ("per-row kernels (--exact-batching on): a prefill of fewer rows is not the cold one's bits by "
               "construction; --exact-batching gemm uses hits")

# (prompt tokens, cached blocks): short to conversation-long prompts, cuts early and late.
CASES = ((2 * BLOCK_TOKENS + 5, 1), (6 * BLOCK_TOKENS + 3, 4), (12 * BLOCK_TOKENS + 9, 11), (40 * BLOCK_TOKENS + 7, 33))


def _plain_token_ids(engine, n: int, seed: int) -> torch.Tensor:
    """[1, n] ids from the widest range of the vocabulary that holds none of the config's special
    ids (a media placeholder would ask for features)."""
    special = set()
    for config in (engine.config, getattr(engine.config, "thinker_config", None), engine.model.config.text_config):
        for name, value in vars(config or object()).items():
            if (name.endswith("_token_id") or name.endswith("_token_index")) and isinstance(value, int):
                special.add(value)
    vocab = int(engine.model.config.text_config.vocab_size)
    bounds = [-1, *sorted(s for s in special if 0 <= s < vocab), vocab]
    low, high = max(zip(bounds, bounds[1:]), key=lambda pair: pair[1] - pair[0])
    return torch.randint(low + 1, high, (1, n), generator=torch.Generator().manual_seed(seed))


def _differs(engine, tokens: int, cached_blocks: int, scratch: PrefixCache) -> str | None:
    ids = _plain_token_ids(engine, tokens, seed=tokens).to(engine.device)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    positions = engine.model._prepare_position_ids_for_generation(ids, dict(kwargs))
    if engine.prefill_drops_attention_mask:
        kwargs.pop("attention_mask")
    timer = ForwardTimer()  # not the engine's, which its own thread reads
    cold, cold_cache, cold_hidden, cold_finals = engine.forward_prompt(kwargs, positions, PrefixHit(), True,
                                                                       scratch, timer)
    keys = block_keys(ids[0].tolist(), {})
    scratch.store(keys[:cached_blocks], cold_cache, cold_finals, cold_hidden, first=0)
    hit = scratch.lookup(keys, cached_blocks, need_extras=True)
    warm, warm_cache, warm_hidden, _ = engine.forward_prompt(kwargs, positions, hit, True, scratch, timer)
    where = f"a {tokens}-token prompt from {cached_blocks * BLOCK_TOKENS} cached tokens"
    if not torch.equal(cold.logits[0, -1], warm.logits[0, -1]):
        return f"{where}: the last logits differ"
    for layer, (a, b) in enumerate(zip(cold_cache.layers, warm_cache.layers)):
        if not (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)):
            return f"{where}: layer {layer}'s keys or values differ"
    if not torch.equal(cold_hidden, warm_hidden):
        return f"{where}: the hidden states the talker reads differ"
    return None


@torch.inference_mode()
def probe_prefix_hits(engine, kernels: ExactKernels) -> str | None:
    """None if every case gave the same bits both ways, prefilled along `kernels` (the paths the
    check adopts); else why not."""
    scratch = engine.prefix.empty_like(max(c for _, c in CASES))
    why = None
    try:
        with using_kernels(kernels):  # the paths its steps run (the invariant GEMM with --exact-batching gemm)
            for tokens, cached_blocks in CASES:
                why = _differs(engine, tokens, cached_blocks, scratch)
                if why:
                    break
    except Exception as exc:  # noqa: BLE001 - a probe that cannot run means: not exact here
        why = f"probe failed: {type(exc).__name__}: {exc}"
    return why


def refused_hits(engine, kernels: ExactKernels) -> str | None:
    """Exact mode: why it refuses prefix-cache hits here, None when it uses them (the check's
    report, logged once, carries it)."""
    if not engine.engine_config.exact_gemm:
        return ROWS_REFUSE
    return probe_prefix_hits(engine, kernels)
