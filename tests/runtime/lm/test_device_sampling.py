"""The device sampler (services/runtime/lm/device_sampling.py) on CPU tensors, against the host path
(sampling.py, itself checked against transformers' processors): greedy rows pick the host's ids bit
for bit, penalty included; sampled rows draw only what the host's processors leave and with their
probabilities; a (key, counter) replays its token whatever shares the batch; the penalty history is
per slot and a reset clears it; one step's tensors come back through one copy."""

from __future__ import annotations

import torch

from services.runtime.lm.device_sampling import Draw, HostCopy, SlotSampler, exponential_noise
from services.runtime.lm.sampling import SamplingConfig, process_scores, select_token

VOCAB = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_pick_the_host_paths_ids():
    logits = _logits(6)
    logits[5, 0] = logits[5].max() + 0.1  # just above the rest: a penalty of 2 moves the row off it
    suppress = torch.zeros(VOCAB, dtype=torch.bool)
    suppress[-8:] = True
    sampler = SlotSampler(8, VOCAB, "cpu", suppress)
    histories = {0: [], 1: [3, 5, 7], 2: list(range(0, VOCAB, 3)), 3: [1], 4: [], 5: [0]}
    penalties = [1.0, 1.3, 1.05, 0.8, 1.3, 2.0]
    draws = []
    for row, slot in enumerate((2, 0, 5, 7, 1, 3)):
        sampler.reset(slot, histories[row])
        draws.append(Draw(slot, SamplingConfig(repetition_penalty=penalties[row])))
    ids = sampler.sample(logits, draws).tolist()
    host = [select_token(logits[row], d.cfg, histories[row], None, suppress) for row, d in enumerate(draws)]
    assert ids == host
    assert ids[5] != 0


def test_top_k_1_is_greedy_and_forced_ids_win():
    logits = _logits(4, seed=1)
    sampler = SlotSampler(4, VOCAB, "cpu")
    sampled = SamplingConfig(temperature=0.7, top_k=1)
    ids = sampler.sample(logits, [Draw(slot, sampled, key=9, counter=slot) for slot in range(4)], remember=False)
    assert ids.tolist() == logits.argmax(-1).tolist()
    forced = sampler.sample(logits[:2], [Draw(0, sampled, forced=11), Draw(1, sampled)], remember=False)
    assert forced.tolist() == [11, int(logits[1].argmax())]


def _draw_many(sampler: SlotSampler, row: torch.Tensor, cfg: SamplingConfig, n: int, slot: int = 0) -> torch.Tensor:
    """n draws of one row's logits, each its own counter (one batched call)."""
    return sampler.sample(row.expand(n, -1), [Draw(slot, cfg, key=1234, counter=c) for c in range(n)], remember=False)


def test_sampled_rows_draw_only_what_the_host_keeps_with_its_probabilities():
    row = _logits(1, seed=2)[0]
    sampler = SlotSampler(1, VOCAB, "cpu")
    for cfg in (SamplingConfig(temperature=0.8), SamplingConfig(temperature=1.0, top_k=5),
                SamplingConfig(temperature=1.3, top_p=0.6), SamplingConfig(temperature=0.9, top_k=10, top_p=0.8)):
        probs = torch.softmax(process_scores(row, cfg, []), dim=-1)
        drawn = _draw_many(sampler, row, cfg, 8000)
        assert set(drawn.tolist()) <= set(torch.nonzero(probs).flatten().tolist()), cfg
        freq = torch.bincount(drawn, minlength=VOCAB).float() / drawn.numel()
        assert float((freq - probs).abs().max()) < 0.025, cfg


def test_top_p_on_a_flat_row_draws_exactly_the_tokens_the_host_keeps():
    """Pinned: the device's top-p keeping one token fewer than the host's (its least likely kept
    token dropped), which the test above lets through: its rows keep few tokens, and a dropped one's
    probability can sit under its frequency tolerance. On this flatter row the host keeps 13 tokens,
    the least likely at about 4 %; the draws (a fixed key, so the same every run) must be those 13,
    every one, and nothing else."""
    row = _logits(1, seed=2)[0]
    cfg = SamplingConfig(temperature=3.0, top_p=0.6)
    kept = set(torch.nonzero(torch.softmax(process_scores(row, cfg, []), dim=-1)).flatten().tolist())
    assert len(kept) == 13
    assert set(_draw_many(SlotSampler(1, VOCAB, "cpu"), row, cfg, 4000).tolist()) == kept


def test_a_seed_replays_its_tokens_whatever_shares_the_batch():
    logits = _logits(5, seed=3)
    cfg = SamplingConfig(temperature=1.0, top_p=0.95, seed=7)
    sampler = SlotSampler(5, VOCAB, "cpu")
    mine = Draw(0, cfg, key=77, counter=3)
    alone = sampler.sample(logits[2:3], [mine], remember=False)
    others = [Draw(s, SamplingConfig(temperature=1.0), key=s, counter=3) for s in range(1, 5)]
    together = sampler.sample(logits[[0, 1, 2, 3]], [others[0], others[1], mine, others[2]], remember=False)
    assert int(together[2]) == int(alone[0])
    # Other counters or keys give other draws (the noise is not one fixed vector).
    flat = torch.zeros(1, VOCAB)
    draws = {int(sampler.sample(flat, [Draw(0, cfg, key=77, counter=c)], remember=False)) for c in range(40)}
    assert len(draws) > 20


def test_the_penalty_history_is_the_slots_own_and_a_reset_clears_it():
    row = torch.zeros(VOCAB)
    row[10], row[20] = 5.0, 4.0
    sampler = SlotSampler(3, VOCAB, "cpu")
    cfg = SamplingConfig(repetition_penalty=2.0)
    for slot in range(3):
        sampler.reset(slot)
    first = sampler.sample(row.expand(2, -1), [Draw(0, cfg), Draw(1, cfg)])
    assert first.tolist() == [10, 10]
    assert sampler.seen[0, 10] and sampler.seen[1, 10] and not sampler.seen[2].any()
    # 10 is penalized (5 / 2 < 4) in slots 0 and 1, not in slot 2, which drew nothing yet.
    assert sampler.sample(row.expand(3, -1), [Draw(0, cfg), Draw(1, cfg), Draw(2, cfg)]).tolist() == [20, 20, 10]
    # Slots 0 and 1 have now drawn 10 and 20 (5 / 2 > 4 / 2: 10 again). Slot 1 taken by a new
    # request whose history holds 10 alone: it draws 20.
    sampler.reset(1, [10])
    assert sampler.seen[1].nonzero().flatten().tolist() == [10]
    assert sampler.sample(row.expand(2, -1), [Draw(0, cfg), Draw(1, cfg)]).tolist() == [10, 20]


def test_the_noise_is_exponential():
    noise = exponential_noise(torch.tensor([5, 6]), torch.tensor([0, 0]), 50000)
    assert noise.shape == (2, 50000) and bool((noise > 0).all())
    assert abs(float(noise.mean()) - 1.0) < 0.02
    assert not torch.equal(noise[0], noise[1])
    assert torch.equal(noise, exponential_noise(torch.tensor([5, 6]), torch.tensor([0, 0]), 50000))


def test_one_copy_brings_every_part_back():
    copy = HostCopy("cpu")
    parts = [torch.arange(5), torch.randn(3, 4).to(torch.bfloat16), torch.tensor([True, False, True]),
             torch.randn(2, 7)]
    indices = [copy.add(p) for p in parts]
    host = copy.fetch()
    assert [torch.equal(host[i], p) and host[i].dtype == p.dtype for i, p in zip(indices, parts)] == [True] * 4
    assert copy.fetch() == []


def test_the_device_sampling_flag_reaches_the_engines_setting():
    import argparse

    import pytest

    from services.base.errors import UserError
    from services.runtime.lm.device_sampling import device_sampling_wanted
    from services.runtime.model.settings import add_engine_flags, device_sampling

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert device_sampling(parser.parse_args([])) is None  # auto: where the device is cuda
    assert device_sampling_wanted(None, "cuda:1") and not device_sampling_wanted(None, "cpu")
    assert device_sampling(parser.parse_args(["--device-sampling", "on"])) is True
    assert device_sampling(parser.parse_args(["--device-sampling", "off"])) is False
    with pytest.raises(UserError, match="OMNI_DEVICE_SAMPLING"):
        device_sampling(argparse.Namespace(device_sampling="yes"))  # from the environment, unchecked by argparse


def test_non_finite_rows_read_as_nonfinite_on_the_host_and_the_device_keeps_its_ids():
    from services.runtime.lm.device_sampling import NONFINITE, mark_nonfinite

    logits = _logits(4, seed=5)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    ids = SlotSampler(4, VOCAB, "cpu").sample(logits, [Draw(s, SamplingConfig()) for s in range(4)], remember=False)
    marked = mark_nonfinite(ids, logits)
    assert marked.tolist() == [int(ids[0]), NONFINITE, NONFINITE, int(ids[3])]
    assert ids.min() >= 0  # what the device goes on with stays a valid index


def test_a_captured_steps_op_set_draws_what_the_rows_own_draws():
    # A decode graph runs the sampler with its variant's fixed op set (penalty and forced ids always,
    # temperature for "sampled", top-k / top-p for "truncated"), its rows' settings a graph input:
    # every row draws what the eager sampler, which runs only what some row asks for, draws.
    from services.runtime.lm.device_sampling import VARIANTS, Rows

    logits = _logits(5, seed=8)
    cases = {
        "greedy": [Draw(0, SamplingConfig()), Draw(1, SamplingConfig(repetition_penalty=1.3)),
                   Draw(2, SamplingConfig(), forced=7)],
        "sampled": [Draw(0, SamplingConfig()), Draw(1, SamplingConfig(temperature=0.8), key=3, counter=2)],
        "truncated": [Draw(0, SamplingConfig(temperature=0.7), key=5), Draw(1, SamplingConfig(top_k=5, temperature=1.0)),
                      Draw(2, SamplingConfig(repetition_penalty=1.2))],
    }
    for variant, draws in cases.items():
        own = SlotSampler(4, VOCAB, "cpu")
        captured = SlotSampler(4, VOCAB, "cpu")
        for sampler in (own, captured):
            sampler.reset(1, [3, 5])
        rows = Rows(draws, "cpu")
        assert rows.variant == variant
        for variant_run in VARIANTS[VARIANTS.index(variant):]:  # a richer op set draws the same
            want = own.sample(logits[:len(draws)], rows, remember=False)
            got = captured.sample(logits[:len(draws)], Rows.captured(rows.params, variant_run), remember=False)
            assert torch.equal(got, want), (variant, variant_run)


def test_the_host_path_reads_a_greedy_rows_pick_and_a_sampled_rows_whole_row():
    from services.runtime.lm.sampling import nonfinite_row

    greedy, sampled = SamplingConfig(), SamplingConfig(temperature=0.8)
    row = _logits(1, seed=9)[0]
    assert not nonfinite_row(row, sampled) and not nonfinite_row(row, greedy, int(row.argmax()))
    for bad in (float("nan"), float("inf")):
        poisoned = row.clone()
        poisoned[11] = bad
        assert nonfinite_row(poisoned, sampled)  # before drawing
        assert not nonfinite_row(poisoned, greedy)  # a greedy row is read at its pick
        assert nonfinite_row(poisoned, greedy, int(torch.argmax(poisoned)))  # argmax takes the NaN or the inf
    assert nonfinite_row(torch.full((VOCAB,), float("-inf")), greedy, 0)
