"""The project's sampling arithmetic against transformers' own logits processors, bit for bit.

On the same logits and history, `process_scores` must give exactly the scores that generate's
`LogitsProcessorList` (RepetitionPenalty, SuppressTokens, Temperature, TopK, TopP, in the order
`GenerationMixin._get_logits_processor` builds them) gives, for the thinker's settings, the
talker's (generate's talker defaults: temperature 0.9, top_k 50, penalty 1.05, its suppressed
specials) and the code predictor's (top_k 50, top_p 0.8). Equal scores and the same generator
state draw the same token, which tests/e2e/test_seeded_sampling.py checks through the stack.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.runtime.lm.sampling import (
    GREEDY_BELOW,
    MIN_REPETITION_PENALTY,
    SamplingConfig,
    process_scores,
    select_token,
)

THINKER_VOCAB = 700
CODEBOOK = 64
TALKER_VOCAB = CODEBOOK + 1024
TALKER_EOS = CODEBOOK + 102
TALKER_SUPPRESSED = [i for i in range(TALKER_VOCAB - 1024, TALKER_VOCAB) if i != TALKER_EOS]  # as generate

SETTINGS = {
    # name -> (vocab, SamplingConfig, suppressed ids or None)
    "thinker_all_knobs": (THINKER_VOCAB, SamplingConfig(temperature=0.7, top_k=20, top_p=0.9,
                                                        repetition_penalty=1.3), None),
    "thinker_top_p_only": (THINKER_VOCAB, SamplingConfig(temperature=1.3, top_p=0.5), None),
    "thinker_top_k_only": (THINKER_VOCAB, SamplingConfig(temperature=1.0, top_k=5), None),
    "thinker_penalty_below_one": (THINKER_VOCAB, SamplingConfig(temperature=0.5, top_p=0.95,
                                                                repetition_penalty=0.8), None),
    "talker_generate_defaults": (TALKER_VOCAB, SamplingConfig(temperature=0.9, top_k=50, top_p=1.0,
                                                              repetition_penalty=1.05), TALKER_SUPPRESSED),
    "talker_with_top_p": (TALKER_VOCAB, SamplingConfig(temperature=0.9, top_k=50, top_p=0.7,
                                                       repetition_penalty=1.05), TALKER_SUPPRESSED),
    "code_predictor": (CODEBOOK, SamplingConfig(temperature=0.9, top_k=50, top_p=0.8), None),
    "greedy_with_penalty": (THINKER_VOCAB, SamplingConfig(repetition_penalty=1.2), None),
}


def transformers_processors(cfg: SamplingConfig, suppressed: list[int] | None) -> LogitsProcessorList:
    """What `_get_logits_processor` appends for these settings, in its order."""
    out = LogitsProcessorList()
    if cfg.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(penalty=cfg.repetition_penalty))
    if suppressed:
        out.append(SuppressTokensLogitsProcessor(suppressed))
    if not cfg.greedy:
        if cfg.temperature != 1.0:
            out.append(TemperatureLogitsWarper(cfg.temperature))
        if cfg.top_k > 0:
            out.append(TopKLogitsWarper(top_k=cfg.top_k, min_tokens_to_keep=1))
        if cfg.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=cfg.top_p, min_tokens_to_keep=1))
    return out


def logits_cases(vocab: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(vocab, generator=gen) * 3
    peaked = normal.clone()
    peaked[int(torch.randint(0, vocab, (1,), generator=gen))] = 40.0  # one token holds ~all the mass
    ties = torch.round(torch.randn(vocab, generator=gen) * 2) / 2  # many equal scores: sort order matters
    flat = torch.zeros(vocab)
    return {"normal": normal, "peaked": peaked, "ties": ties, "flat": flat}


@pytest.mark.exactness
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_processed_scores_equal_transformers_logits_processors_bit_for_bit(name):
    vocab, cfg, suppressed = SETTINGS[name]
    processors = transformers_processors(cfg, suppressed)
    assert len(processors) > 0
    suppress = None
    if suppressed:
        suppress = torch.zeros(vocab, dtype=torch.bool)
        suppress[suppressed] = True
    for seed in range(5):
        gen = torch.Generator().manual_seed(100 + seed)
        history = torch.randint(0, min(vocab, 200), (30,), generator=gen).tolist()  # with repeats
        for kind, logits in logits_cases(vocab, seed).items():
            ours = process_scores(logits, cfg, history, suppress)
            theirs = processors(torch.tensor([history]), logits.clone()[None])[0]
            assert ours.dtype == theirs.dtype == torch.float32
            assert torch.equal(ours, theirs), f"{name}, {kind} logits, seed {seed}: scores differ"
            kept = torch.isfinite(ours).sum().item()
            assert kept >= 1


def test_the_settings_actually_filter_so_the_comparison_means_something():
    # top-k and top-p remove tokens, the penalty moves the penalised scores, suppression removes the
    # specials: each case compares non-trivial processing.
    logits = logits_cases(THINKER_VOCAB, 0)["normal"]
    _, cfg, _ = SETTINGS["thinker_all_knobs"]
    assert torch.isfinite(process_scores(logits, cfg, [1, 2, 3])).sum() <= 20
    _, cfg, _ = SETTINGS["thinker_top_p_only"]
    assert 1 < torch.isfinite(process_scores(logits, cfg, [])).sum() < THINKER_VOCAB
    vocab, cfg, suppressed = SETTINGS["talker_generate_defaults"]
    suppress = torch.zeros(vocab, dtype=torch.bool)
    suppress[suppressed] = True
    scores = process_scores(logits_cases(vocab, 0)["normal"], cfg, [5], suppress)
    assert torch.isinf(scores[suppressed]).all() and torch.isfinite(scores[TALKER_EOS])


@pytest.mark.exactness
def test_a_seeded_generator_draws_what_generates_global_generator_draws():
    # generate draws with torch.multinomial(softmax(scores) [1, vocab], 1) from the global generator;
    # the engines with a per-request torch.Generator seeded the same: same tokens, in order.
    vocab, cfg, _ = SETTINGS["thinker_all_knobs"]
    steps = [logits_cases(vocab, s)["normal"] for s in range(20)]
    ours_gen = torch.Generator().manual_seed(1234)
    ours = [select_token(logits, cfg, [], ours_gen) for logits in steps]
    torch.manual_seed(1234)
    processors = transformers_processors(cfg, None)
    theirs = []
    for logits in steps:
        scores = processors(torch.zeros((1, 0), dtype=torch.long), logits.clone()[None])
        theirs.append(int(torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)[0, 0]))
    assert ours == theirs
    assert len(set(ours)) > 1  # really sampled


@pytest.mark.parametrize("temperature", [1.4013e-45, 1e-30, GREEDY_BELOW / 2])
def test_a_temperature_below_greedy_below_decodes_greedily(temperature):
    # The fuzzer's case: 1.4e-45 (the smallest float32) divided the logits to inf and softmax to NaN,
    # and the stage failed INTERNAL.
    logits = torch.tensor([3.0, -1.0, 40.0, 39.5])
    cfg = SamplingConfig(temperature=temperature, seed=1)
    assert cfg.greedy and cfg.generator() is None
    assert select_token(logits, cfg, [], None) == 2


def test_the_extremes_the_stages_accept_keep_probabilities_finite():
    # The smallest sampling temperature and repetition penalty a request may set, on logits far above
    # a real model's, with every token repeated: the scores stay finite and a token is drawn.
    logits = torch.tensor([300.0, 299.0, -300.0, 0.5])
    cfg = SamplingConfig(temperature=GREEDY_BELOW, repetition_penalty=MIN_REPETITION_PENALTY, seed=3)
    scores = process_scores(logits, cfg, [0, 1, 2, 3])
    assert torch.isfinite(torch.softmax(scores, dim=-1)).all()
    assert select_token(logits, cfg, [0, 1, 2, 3], cfg.generator()) == 0
