"""Token selection: greedy by default; temperature, top-k, top-p and repetition penalty on demand.

Greedy (temperature unset, 0, or below `GREEDY_BELOW`) is bit-exact with transformers'
`generate(do_sample=False)`, including the repetition penalty, which it applies the same way
(divide positive scores, multiply negative ones, for every token already in `history`).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch


def _float32(x: float) -> float:
    """`x` as the wire's float32 carries it: a bound compared with what a request sent must be this,
    or a request that sends the bound itself (0.01 arrives as 0.0099999998) falls on the wrong side."""
    return struct.unpack("f", struct.pack("f", x))[0]


# A temperature below this decodes greedily: logits divided by less overflow float32 (a temperature of
# 1e-45 made every score inf and softmax NaN), and the draw is the argmax in all but ties anyway.
# vLLM draws the same line (its _SAMPLING_EPS).
GREEDY_BELOW = _float32(1e-5)
# The smallest repetition penalty a stage accepts: a repeated token's positive score is divided by it,
# so a smaller one can overflow float32 to inf too (two infs make softmax NaN).
MIN_REPETITION_PENALTY = _float32(0.01)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # below GREEDY_BELOW (0 included) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 64
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else torch.seed())
        return gen


def apply_repetition_penalty(scores: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    """scores: [vocab] float; as transformers' RepetitionPenaltyLogitsProcessor."""
    if penalty == 1.0 or not history:
        return scores
    idx = torch.tensor(sorted(set(history)), dtype=torch.long)
    picked = scores.gather(0, idx)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return scores.scatter(0, idx, picked)


def process_scores(
    logits: torch.Tensor,
    cfg: SamplingConfig,
    history: list[int],
    suppress: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scores a token is drawn from: [vocab] float32. Bit for bit what transformers' logits
    processors give, in generate's order (tests/runtime/lm/test_sampling_vs_transformers.py):
    RepetitionPenalty, SuppressTokens, then for sampling Temperature, TopK, TopP."""
    scores = apply_repetition_penalty(logits.float(), history, cfg.repetition_penalty)
    if suppress is not None:
        scores = scores.masked_fill(suppress, float("-inf"))
    if cfg.greedy:
        return scores
    if cfg.temperature != 1.0:
        scores = scores / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(scores, min(cfg.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        # As TopPLogitsWarper: ascending sort, drop the tokens whose cumulative probability (from the
        # least likely up) is at most 1 - top_p, always keeping the most likely one.
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - cfg.top_p)
        drop[-1:] = False
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return scores


def select_token(
    logits: torch.Tensor,
    cfg: SamplingConfig,
    history: list[int],
    generator: torch.Generator | None,
    suppress: torch.Tensor | None = None,
) -> int:
    """logits: [vocab] for one position. suppress: [vocab] bool mask of forbidden ids."""
    scores = process_scores(logits, cfg, history, suppress)
    if cfg.greedy:
        return int(torch.argmax(scores))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def nonfinite_row(logits: torch.Tensor, cfg: SamplingConfig, token: int | None = None) -> bool:
    """Whether a row's logits [vocab] (on the host) hold NaN or inf, as far as its draw reads them:
    a sampled row's whole row, before drawing (a draw from NaN probabilities raises); a greedy row's
    picked logit (`token`), one read instead of a pass over the vocabulary: argmax propagates NaN (a
    row holding one picks it), +inf is its own maximum, and a row of -inf picks -inf."""
    if token is None:
        return not cfg.greedy and not bool(torch.isfinite(logits).all())
    return not math.isfinite(float(logits[token]))
