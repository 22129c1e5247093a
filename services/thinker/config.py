"""The thinker service's configuration: built once from flags and environment, frozen, passed in."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.runtime.inputs.prompt import PromptLimits
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from services.thinker.engine import ThinkerEngineConfig


class Backend(enum.StrEnum):
    TRANSFORMERS = "transformers"  # this project's engine over transformers' modules (services/thinker/engine.py)
    VLLM = "vllm"  # vLLM's engine (services/thinker/vllm_backend.py; optional install: make setup-vllm)


@dataclass(frozen=True)
class ThinkerConfig:
    serving: ServingConfig
    model: ModelConfig
    engine: ThinkerEngineConfig = ThinkerEngineConfig()
    default_max_new_tokens: int = 512
    max_new_tokens_limit: int = 4096
    limits: PromptLimits = PromptLimits()
    backend: Backend = Backend.TRANSFORMERS
    vllm_kv_cache_bytes: int | None = None  # vLLM's KV cache; None: its own sizing (GPU memory fraction)
    vllm_gpu_memory_utilization: float = 0.9
    audio_first: bool = False  # hold a spoken request's text near the talker's need until it answers
