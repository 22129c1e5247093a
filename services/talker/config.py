"""The talker service's configuration: built once from flags and environment, frozen, passed in
(to the server and to its family adapter, which checks requests against its limits)."""

from __future__ import annotations

from dataclasses import dataclass

from services.runtime.chunking import DEFAULT_CHUNKS, ChunkPolicy
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from services.talker.engine_base import TalkerEngineConfig


@dataclass(frozen=True)
class TalkerConfig:
    serving: ServingConfig
    model: ModelConfig
    engine: TalkerEngineConfig = TalkerEngineConfig()
    chunks: ChunkPolicy = DEFAULT_CHUNKS  # how frames are cut into chunks for code2wav
    default_max_new_tokens: int = 2048
    max_new_tokens_limit: int = 8192
