"""Token selection: greedy by default; temperature, top-k, top-p and repetition penalty on demand.

Greedy (temperature unset or 0) is bit-exact with transformers' `generate(do_sample=False)`,
including the repetition penalty, which it applies the same way (divide positive scores,
multiply negative ones, for every token already in `history`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 64
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else torch.seed())
        return gen


def sampling_from_proto(p, field: str, default_max_new_tokens: int, max_new_tokens_limit: int,
                        default_repetition_penalty: float = 1.0) -> SamplingConfig:
    """omni.v1.SamplingParams -> SamplingConfig, validating every set field."""
    cfg = {"max_new_tokens": default_max_new_tokens, "repetition_penalty": default_repetition_penalty}
    if p.HasField("temperature"):
        if not (0.0 <= p.temperature <= 10.0):
            raise InvalidArgument(f"{field}.temperature", f"must be in [0, 10], got {p.temperature}")
        cfg["temperature"] = float(p.temperature)
    if p.HasField("top_k"):
        if p.top_k < 0:
            raise InvalidArgument(f"{field}.top_k", f"must be >= 0, got {p.top_k}")
        cfg["top_k"] = int(p.top_k)
    if p.HasField("top_p"):
        if not (0.0 < p.top_p <= 1.0):
            raise InvalidArgument(f"{field}.top_p", f"must be in (0, 1], got {p.top_p}")
        cfg["top_p"] = float(p.top_p)
    if p.HasField("repetition_penalty"):
        if not (0.0 < p.repetition_penalty <= 10.0):
            raise InvalidArgument(f"{field}.repetition_penalty", f"must be in (0, 10], got {p.repetition_penalty}")
        cfg["repetition_penalty"] = float(p.repetition_penalty)
    if p.HasField("max_new_tokens"):
        if not (1 <= p.max_new_tokens <= max_new_tokens_limit):
            raise InvalidArgument(
                f"{field}.max_new_tokens", f"must be in [1, {max_new_tokens_limit}], got {p.max_new_tokens}"
            )
        cfg["max_new_tokens"] = int(p.max_new_tokens)
    if p.HasField("seed"):
        cfg["seed"] = int(p.seed)
    return SamplingConfig(**cfg)


def apply_repetition_penalty(scores: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    """scores: [vocab] float; as transformers' RepetitionPenaltyLogitsProcessor."""
    if penalty == 1.0 or not history:
        return scores
    idx = torch.tensor(sorted(set(history)), dtype=torch.long)
    picked = scores.gather(0, idx)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return scores.scatter(0, idx, picked)


def select_token(
    logits: torch.Tensor,
    cfg: SamplingConfig,
    history: list[int],
    generator: torch.Generator | None,
    suppress: torch.Tensor | None = None,
) -> int:
    """logits: [vocab] for one position. suppress: [vocab] bool mask of forbidden ids."""
    scores = apply_repetition_penalty(logits.float(), history, cfg.repetition_penalty)
    if suppress is not None:
        scores = scores.masked_fill(suppress, float("-inf"))
    if cfg.greedy:
        return int(torch.argmax(scores))
    scores = scores / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(scores, min(cfg.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_scores, dim=-1) > cfg.top_p  # keep the token that crosses top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
