"""The code2wav service's configuration: built once from flags and environment, frozen, passed in
(to the server and to its family adapter, which builds the engine from it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.code2wav.blocks import BlockGrid
from services.code2wav.token2wav import StreamContext
from services.runtime.chunking import DEFAULT_CHUNKS
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig


class Decoder(enum.StrEnum):
    """Qwen3-Omni's decoder (`--decoder`), one engine each (engine.py)."""

    INCREMENTAL = "incremental"  # every frame decoded once, exact for any vocoder (incremental.py)
    WINDOW = "window"  # left context re-decoded per block (window.py); exact for short reach only


@dataclass(frozen=True)
class Code2WavConfig:
    serving: ServingConfig
    model: ModelConfig
    left_context: int = 25  # Decoder.WINDOW: frames of context decoded before each block
    decoder: Decoder = Decoder.INCREMENTAL
    # Where blocks start: every vocoder call decodes a whole block (blocks.py); the talker's chunk
    # schedule (4, 8, 16, 25, 25, ...), so a talker that keeps to it sends whole blocks.
    blocks: BlockGrid = BlockGrid(DEFAULT_CHUNKS.schedule())
    max_batch: int = 16  # requests' blocks decoded in one call at most (where exact mode's check allows, plan.py; 64 on cuda)
    max_batch_frames: int = 64  # frames one call decodes at most over its batch (0: no bound; the cuda default)
    delivery_ms: float = 100.0  # a running request's block is due this long before its listener runs dry
    # Decoder.WINDOW: window lengths captured as CUDA graphs at start-up (others on first use); empty:
    # the block grid's (window.window_lengths).
    graph_windows: tuple[int, ...] = ()
    # Qwen2.5-Omni's streaming Token2Wav: tokens of context around each chunk (services/code2wav/token2wav.py).
    token2wav_context: StreamContext = StreamContext()
    # Exact mode: Qwen3-Omni's batches and open blocks checked beside serving (plan.py); Qwen2.5-Omni's
    # Token2Wav decodes each window alone (token2wav_engine.py): bit-identical whatever else decodes.
    exact: bool = True
