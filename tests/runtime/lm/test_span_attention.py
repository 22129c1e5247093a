"""The batched decode attention of exact batching off (services/runtime/lm/kernels.py, `span_attention`,
and kv_slots.BatchView's `SlotSpan`): one SDPA over the batch's used positions, GQA without expanding
the keys, each row seeing only its own positions; equal to the row-wise attention to rounding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.runtime.lm.kernels import RowKV, SlotSpan, _rowwise_attention, span_attention
from services.runtime.lm.kv_slots import SlotKVCache
from services.runtime.lm.static_decode import StaticSlotView, spans_for


def _expanded_sdpa(query, keys, values, scaling):
    """Each row alone, its keys and values repeated to every query head (transformers' SDPA path with
    a mask), query t of T seeing the row's keys up to its own position (the last T are the step's)."""
    groups, tokens = query.shape[1] // keys[0].shape[1], query.shape[2]
    rows = [torch.nn.functional.scaled_dot_product_attention(
        query[i:i + 1], k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), scale=scaling,
        attn_mask=torch.ones(tokens, k.shape[2], dtype=torch.bool).tril(k.shape[2] - tokens))
        for i, (k, v) in enumerate(zip(keys, values))]
    return torch.cat(rows).transpose(1, 2)


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4), (8, 1)])
def test_span_attention_is_each_rows_own_attention_without_expanding_the_keys(heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 9, 5]
    span = 12
    query = torch.randn(3, heads, 1, 16, generator=gen)
    keys = torch.randn(3, kv_heads, span, 16, generator=gen)
    values = torch.randn(3, kv_heads, span, 16, generator=gen)
    visible = torch.arange(span) < torch.tensor(lengths)[:, None, None]  # [B, 1, L]
    got = span_attention(query, SlotSpan(keys, visible), SlotSpan(values, visible), 0.25)
    want = _expanded_sdpa(query, [keys[i:i + 1, :, :n] for i, n in enumerate(lengths)],
                          [values[i:i + 1, :, :n] for i, n in enumerate(lengths)], 0.25)
    assert got.shape == (3, 1, heads, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _module(heads: int, kv_heads: int):
    return SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)


@pytest.mark.parametrize("tokens", [1, 2])
def test_a_decode_batch_attends_in_one_call_where_exact_batching_is_off(tokens):
    """BatchView gives one `SlotSpan` (batched) or per-row `RowKV` (exact mode); both attend each row
    over its own slot; a step of 2 new positions each sees its own and those before (the row path
    takes one token a row: transformers' SDPA aligns is_causal to the first key)."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 8, 2, 16
    out = {}
    for batched in (False, True) if tokens == 1 else (True,):
        cache = SlotKVCache(1, 4, kv_heads, 32, dim)
        cache.batched_attention = batched
        for slot, length in enumerate((4, 11, 0, 7)):
            seeded = torch.Generator().manual_seed(slot)
            cache.keys[0][slot, :, :length] = torch.randn(kv_heads, length, dim, generator=seeded)
            cache.values[0][slot, :, :length] = torch.randn(kv_heads, length, dim, generator=seeded)
            cache.lengths[slot] = length
        view = cache.batch([3, 0, 1])
        gen.manual_seed(1)
        new_k, new_v = (torch.randn(3, kv_heads, tokens, dim, generator=gen) for _ in range(2))
        query = torch.randn(3, heads, tokens, dim, generator=gen)
        key, value = view.update(new_k, new_v, 0)
        assert isinstance(key, SlotSpan if batched else RowKV)
        out[batched] = _rowwise_attention(_module(heads, kv_heads), query, key, value, None, scaling=0.25)[0]
        if batched:  # the span is the longest row's length after the step; each row sees its own
            assert key.states.shape == (3, kv_heads, 11 + tokens, dim)
            assert key.visible.sum(-1).tolist() == [[7 + t + 1 for t in range(tokens)],
                                                     [4 + t + 1 for t in range(tokens)],
                                                     [11 + t + 1 for t in range(tokens)]]
            rows = [(slot, n + tokens) for slot, n in ((3, 7), (0, 4), (1, 11))]
            out["expanded"] = _expanded_sdpa(query, [cache.keys[0][s:s + 1, :, :n] for s, n in rows],
                                             [cache.values[0][s:s + 1, :, :n] for s, n in rows], 0.25)
    assert out[True].shape == (3, tokens, heads, dim)
    torch.testing.assert_close(out[True], out["expanded"], rtol=1e-5, atol=1e-6)
    if tokens == 1:
        torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-6)


def test_a_single_row_keeps_the_row_path():
    cache = SlotKVCache(1, 2, 1, 8, 4)
    cache.batched_attention = True
    key, _ = cache.batch([1]).update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), 0)
    assert isinstance(key, RowKV)  # a view of its own slot: nothing gathered


def test_spans_double_from_the_shortest_to_the_max_model_len():
    assert spans_for(4096) == (256, 512, 1024, 2048, 4096)
    assert spans_for(3000) == (256, 512, 1024, 2048, 3000)
    assert spans_for(256) == (256,) and spans_for(96) == (96,) and spans_for(96, 20) == (20, 40, 80, 96)


def test_the_static_view_attends_over_its_span_only():
    cache = SlotKVCache(1, 3, 2, 64, 4)
    slots, positions = torch.tensor([2, 0]), torch.tensor([5, 30])
    view = StaticSlotView(cache, slots, positions, torch.arange(32))
    key, value = view.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4), 0)
    assert key.states.shape == (2, 2, 32, 4)
    assert view.visible.shape == (2, 1, 32) and view.visible.sum(-1).flatten().tolist() == [6, 31]
    assert torch.equal(cache.keys[0][2, :, 5], torch.ones(2, 4)) and torch.equal(cache.keys[0][0, :, 30], torch.ones(2, 4))
