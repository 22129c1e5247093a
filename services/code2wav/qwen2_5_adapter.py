"""Qwen2.5-Omni's code2wav as the server drives it (adapter.py): streaming Token2Wav
(`Token2WavEngine`, token2wav_engine.py; no CUDA graphs) conditioned on the checkpoint's voices
(spk_dict.pt), the start message's voice matched case-insensitively against them; frames of one
codec token (docs/qwen2_5-omni-token2wav.md)."""

from __future__ import annotations

import logging

from omni.v1 import stages_pb2
from services.base.families import DEFAULT_VOICES, Family
from services.code2wav.adapter import codec_input_from_proto
from services.code2wav.config import Code2WavConfig
from services.code2wav.engine import CodecChunk, CodecEnd
from services.code2wav.token2wav import geometry_of, voices_of
from services.code2wav.token2wav_engine import Token2WavEngine, Token2WavStart
from services.runtime.model.checkpoint import LoadedStage, load_voices

log = logging.getLogger(__name__)


class Qwen2_5Code2WavAdapter:
    num_quantizers = 1  # a frame is one codec token

    def __init__(self, loaded: LoadedStage, config: Code2WavConfig):
        self.loaded = loaded  # Qwen2_5OmniToken2WavModel and the whole Qwen2_5OmniConfig
        self.config = config
        mel_dim = loaded.config.token2wav_config.dit_config.mel_dim
        self.voices = voices_of(load_voices(config.model.checkpoint), mel_dim)  # name -> conditioning
        default = DEFAULT_VOICES[Family.QWEN2_5_OMNI].lower()
        self.default_voice = next((n for n in self.voices if n.lower() == default), next(iter(self.voices)))
        self.codebook_size = geometry_of(loaded.model).num_embeds

    @staticmethod
    def stage_of(whole_model):
        return whole_model.token2wav  # Qwen2_5OmniForConditionalGeneration's Token2Wav

    def build_engine(self) -> Token2WavEngine:
        if self.config.model.graphs.enabled:
            log.warning("CUDA graphs are not implemented for Token2Wav: decoding eagerly")
        return Token2WavEngine(self.loaded.model, self.voices, default_voice=self.default_voice,
                               context=self.config.token2wav_context, max_batch=self.config.max_batch,
                               exact=self.config.exact)

    def job_from_proto(self, start: stages_pb2.Code2WavStart) -> Token2WavStart:
        return Token2WavStart(voice=self.engine_voice(start.voice if start.HasField("voice") else None))

    def engine_voice(self, voice: str | None) -> str | None:
        """The engine's spelling of `voice` (matched case-insensitively, as the thinker does);
        None: the default."""
        if voice is None:
            return None
        names = {name.lower(): name for name in self.voices}
        return names.get(voice.lower(), voice)  # an unknown one fails in the engine, naming it

    def input_from_proto(self, message: stages_pb2.Code2WavInput) -> CodecChunk | CodecEnd:
        return codec_input_from_proto(message, self.num_quantizers, self.codebook_size)

    def frames_to_first_audio(self, first_chunk_frames: int) -> int:
        # The first DiT window waits for a chunk and its look-ahead (token2wav.py, NOTE "algorithm").
        context = self.config.token2wav_context
        return context.chunk + context.ahead
