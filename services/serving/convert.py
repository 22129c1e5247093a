"""Proto <-> runtime conversions that every stage shares, validating as they go."""

from __future__ import annotations

from omni.v1 import common_pb2
from services.base.errors import InvalidArgument
from services.base.finish import FinishReason
from services.runtime.lm.sampling import MIN_REPETITION_PENALTY, SamplingConfig

_FINISH_REASONS = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}


def finish_reason_to_proto(reason: FinishReason) -> int:
    return _FINISH_REASONS[reason]


def sampling_to_proto(sampling: SamplingConfig) -> common_pb2.SamplingParams:
    """SamplingConfig -> omni.v1.SamplingParams with every field set (what a stage reads back is
    the same config, its floats rounded to float32 as on the wire)."""
    p = common_pb2.SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                  repetition_penalty=sampling.repetition_penalty,
                                  max_new_tokens=sampling.max_new_tokens)
    if sampling.seed is not None:
        p.seed = sampling.seed
    return p


def sampling_from_proto(p: common_pb2.SamplingParams, field: str, default_max_new_tokens: int, max_new_tokens_limit: int,
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
        if not (MIN_REPETITION_PENALTY <= p.repetition_penalty <= 10.0):
            raise InvalidArgument(f"{field}.repetition_penalty",
                                  f"must be in [{MIN_REPETITION_PENALTY:.2g}, 10], got {p.repetition_penalty:g}")
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
