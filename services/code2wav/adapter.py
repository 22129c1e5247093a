"""What the code2wav server needs of a model family: one adapter per family, picked once at start
(server.ADAPTERS, by the checkpoint's model_type), so the servicer has no family branches.

Qwen3-Omni's is qwen3_adapter.py (the vocoder, with the incremental or the window engine),
Qwen2.5-Omni's qwen2_5_adapter.py (streaming Token2Wav). An adapter builds the family's engine
from the loaded stage and the service's config, and turns the talker's stage messages
(stages.proto: `Code2WavStart`, then `CodecFrames` and `CodecEnd`) into engine inputs, refusing
bad ones with InvalidArgument naming the field (the engine's own checks would end the stream
INTERNAL). What the engine emits (`Audio`, then `Decoded`) is the same for every family.
"""

from __future__ import annotations

from typing import Protocol

from omni.v1 import stages_pb2
from services.base.engine import Engine
from services.base.errors import InvalidArgument
from services.code2wav.engine import CodecChunk, CodecEnd
from services.serving.wire import frames_from_proto


class Code2WavAdapter(Protocol):
    num_quantizers: int  # codes a frame (Qwen3-Omni: 16, Qwen2.5-Omni: 1)
    codebook_size: int  # codec ids the vocoder embeds: [0, codebook_size)

    @staticmethod
    def stage_of(whole_model):
        """The stage's module in the family's whole transformers model (what the reference loads),
        for in-process use beside it (bench/floor.py)."""

    def build_engine(self) -> Engine:
        """The family's engine (called once, at start-up)."""

    def job_from_proto(self, start: stages_pb2.Code2WavStart):
        """What the engine's `add` takes for the stream's start message."""

    def input_from_proto(self, message: stages_pb2.Code2WavInput) -> CodecChunk | CodecEnd:
        """A message after start: frames, checked against the vocoder's limits, or the end mark."""

    def frames_to_first_audio(self, first_chunk_frames: int) -> int:
        """Codec frames the engine needs before its first audio when the talker's first chunk has
        `first_chunk_frames` (more where the decoder looks ahead)."""


def codec_input_from_proto(message: stages_pb2.Code2WavInput, num_quantizers: int,
                           codebook_size: int) -> CodecChunk | CodecEnd:
    """Frames ([n, num_quantizers] ids in [0, codebook_size)) or the end mark; InvalidArgument
    naming the field otherwise (WireError for frames that do not split into whole frames)."""
    if message.HasField("frames"):
        frames = frames_from_proto(message.frames)  # [n, num_code_groups] int64
        if frames.shape[1] != num_quantizers:
            raise InvalidArgument("frames.num_code_groups", f"must be {num_quantizers}, got {frames.shape[1]}")
        if frames.numel() and (frames.min() < 0 or frames.max() >= codebook_size):
            raise InvalidArgument("frames.ids", f"codec ids must be in [0, {codebook_size}), got "
                                                f"{int(frames.min())}..{int(frames.max())}")
        return CodecChunk(frames)
    if message.HasField("end"):
        return CodecEnd()
    raise InvalidArgument("event", "expected frames or end after start")
