"""The code2wav service's configuration: built once from flags and environment, frozen, passed in
(to the server and to its family adapter, which builds the engine from it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.code2wav.token2wav import StreamContext
from services.runtime.chunking import DEFAULT_CHUNKS
from services.runtime.settings import ModelConfig
from services.serving.config import ServingConfig


class Decoder(enum.StrEnum):
    """Qwen3-Omni's decoder (`--decoder`), one engine each (engine.py)."""

    INCREMENTAL = "incremental"  # every frame decoded once, exact for any vocoder (incremental.py)
    WINDOW = "window"  # left context re-decoded per chunk, batched (window.py); exact for short reach only


@dataclass(frozen=True)
class Code2WavConfig:
    serving: ServingConfig
    model: ModelConfig
    left_context: int = 25  # Decoder.WINDOW: frames of context decoded before each chunk
    decoder: Decoder = Decoder.INCREMENTAL
    delivery_ms: float = 100.0  # Decoder.INCREMENTAL: a running request's chunk is due this long before its listener runs dry
    # Decoder.WINDOW: window lengths captured as CUDA graphs at start-up (others on first use): those of
    # the talker's default chunks (services/runtime/chunking.py) with `left_context` frames of context.
    graph_windows: tuple[int, ...] = DEFAULT_CHUNKS.windows(25)
    # Qwen2.5-Omni's streaming Token2Wav: tokens of context around each chunk (services/code2wav/token2wav.py).
    token2wav_context: StreamContext = StreamContext()
    # Qwen2.5-Omni's Token2Wav: each window decoded alone, bit-identical whatever else decodes
    # (services/code2wav/token2wav_engine.py); Qwen3-Omni's incremental decoder is per request already.
    exact: bool = True
