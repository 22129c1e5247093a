"""Qwen3-Omni's code2wav as the server drives it (adapter.py): the vocoder (`Qwen3OmniMoeCode2Wav`)
as the configured decoder's block vocoder, `IncrementalVocoder` or `WindowVocoder`, chosen here
once, its batches and open blocks checked beside serving (plan.py), in `Code2WavEngine` (engine.py); frames of
`num_quantizers` codes; the start message's voice is not used (the voice is in the codes already)."""

from __future__ import annotations

import logging

from omni.v1 import stages_pb2
from services.code2wav.adapter import codec_input_from_proto
from services.code2wav.blocks import BlockGrid
from services.code2wav.config import Code2WavConfig, Decoder
from services.code2wav.engine import Code2WavEngine, CodecChunk, CodecEnd
from services.code2wav.graphs import Code2WavGraphs
from services.code2wav.incremental import IncrementalVocoder
from services.code2wav.plan import plan_blocks
from services.code2wav.vocoder import VocoderGeometry, measure_geometry
from services.code2wav.window import WindowVocoder, window_lengths
from services.runtime.model.checkpoint import LoadedStage

log = logging.getLogger(__name__)


def incremental_vocoder(model, geometry: VocoderGeometry, config: Code2WavConfig):
    """grid -> the incremental decoder's vocoder for blocks on that grid, its calls replayed from
    CUDA graphs where enabled (every block shape at the buckets up to --max-batch captured at
    start-up, its request slots allocated for twice --max-batch requests before they grow)."""
    graphs = config.model.graphs if config.model.graphs.enabled else None

    def make(grid: BlockGrid) -> IncrementalVocoder:
        if graphs is None:
            return IncrementalVocoder(model, geometry, grid)
        vocoder = IncrementalVocoder(model, geometry, grid, graphs, slots=2 * config.max_batch)
        vocoder.capture(config.max_batch)
        return vocoder
    return make


def window_vocoder(model, geometry: VocoderGeometry, config: Code2WavConfig):
    """grid -> the window decoder's vocoder for blocks on that grid, its windows from CUDA graphs
    where enabled (the grid's window lengths captured at start-up, others on first use)."""
    graphs = Code2WavGraphs(model, config.model.graphs) if config.model.graphs.enabled else None

    def make(grid: BlockGrid) -> WindowVocoder:
        if graphs is not None:
            graphs.capture(config.graph_windows or window_lengths(grid, config.left_context), int(model.config.num_quantizers))
        return WindowVocoder(model, geometry, grid, config.left_context, graphs.decode if graphs else None)
    return make


VOCODERS = {Decoder.INCREMENTAL: incremental_vocoder, Decoder.WINDOW: window_vocoder}  # decoder -> its vocoder's builder


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
        model, config = self.loaded.model, self.config
        geometry = measure_geometry(model)
        make = VOCODERS[config.decoder](model, geometry, config)
        vocoder, plan, check = plan_blocks(make, config.blocks, config.max_batch, config.exact,
                                           config.max_batch_frames, config.model.checks)
        return Code2WavEngine(vocoder, plan, self.loaded.config, delivery_ms=config.delivery_ms, check=check)

    def job_from_proto(self, start: stages_pb2.Code2WavStart) -> None:
        return None  # the vocoder takes nothing but frames

    def input_from_proto(self, message: stages_pb2.Code2WavInput) -> CodecChunk | CodecEnd:
        return codec_input_from_proto(message, self.num_quantizers, self.codebook_size)

    def frames_to_first_audio(self, first_chunk_frames: int) -> int:
        return first_chunk_frames  # both decoders emit a frame's audio once its (open) block is decoded
