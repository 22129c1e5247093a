"""Qwen3-Omni's code2wav as the server drives it (adapter.py): the vocoder (`Qwen3OmniMoeCode2Wav`)
in the engine of the configured decoder, `IncrementalCode2WavEngine` or `WindowCode2WavEngine`
(engine.py), chosen here once; frames of `num_quantizers` codes; the start message's voice is
not used (the voice is in the codes already)."""

from __future__ import annotations

import logging

from omni.v1 import stages_pb2
from services.code2wav.adapter import codec_input_from_proto
from services.code2wav.config import Code2WavConfig, Decoder
from services.code2wav.engine import (
    Code2WavEngine,
    CodecChunk,
    CodecEnd,
    IncrementalCode2WavEngine,
    WindowCode2WavEngine,
)
from services.runtime.checkpoint import LoadedStage

log = logging.getLogger(__name__)


def incremental_engine(loaded: LoadedStage, config: Code2WavConfig) -> IncrementalCode2WavEngine:
    if config.model.graphs.enabled:
        log.info("the incremental decoder decodes eagerly: CUDA graphs are captured for --decoder window only")
    return IncrementalCode2WavEngine(loaded.model, loaded.config, delivery_ms=config.delivery_ms)


def window_engine(loaded: LoadedStage, config: Code2WavConfig) -> WindowCode2WavEngine:
    return WindowCode2WavEngine(loaded.model, loaded.config, left_context=config.left_context,
                                graphs=config.model.graphs, graph_windows=config.graph_windows)


ENGINES = {Decoder.INCREMENTAL: incremental_engine, Decoder.WINDOW: window_engine}  # decoder -> its engine's builder


class Qwen3Code2WavAdapter:
    def __init__(self, loaded: LoadedStage, config: Code2WavConfig):
        self.loaded = loaded  # Qwen3OmniMoeCode2Wav and the whole Qwen3OmniMoeConfig
        self.config = config
        vocoder = loaded.config.code2wav_config
        self.num_quantizers = int(vocoder.num_quantizers)
        self.codebook_size = int(vocoder.codebook_size)

    @staticmethod
    def stage_of(whole_model):
        return whole_model.code2wav  # Qwen3OmniMoeForConditionalGeneration's vocoder

    def build_engine(self) -> Code2WavEngine:
        return ENGINES[self.config.decoder](self.loaded, self.config)

    def job_from_proto(self, start: stages_pb2.Code2WavStart) -> None:
        return None  # the vocoder takes nothing but frames

    def input_from_proto(self, message: stages_pb2.Code2WavInput) -> CodecChunk | CodecEnd:
        return codec_input_from_proto(message, self.num_quantizers, self.codebook_size)

    def frames_to_first_audio(self, first_chunk_frames: int) -> int:
        return first_chunk_frames  # both decoders emit a chunk's audio once it is decoded
