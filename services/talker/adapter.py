"""What the talker server needs of a model family: one adapter per family, picked once at start
(server.ADAPTERS, by the checkpoint's model_type), so the servicer has no family branches.

Qwen3-Omni's is qwen3_adapter.py, Qwen2.5-Omni's qwen2_5_adapter.py. An adapter knows the
family's engine class and turns the thinker's stage messages (stages.proto: `TalkerStart`, then
`TalkerInput`s) into engine inputs, refusing bad ones with InvalidArgument naming the field. What
the engine emits (frames of `num_code_groups` codes, TalkerDone) is the same for every family.
"""

from __future__ import annotations

from typing import Protocol

from omni.v1 import stages_pb2
from services.runtime.chunking import ChunkPolicy
from services.talker.engine_base import TextEnd


class TalkerAdapter(Protocol):
    engine: type  # the engine class: (model, config, device=, engine_config=)
    cuda_graphs: bool  # False: not implemented for the family; the server decodes eagerly
    # Seconds of audio one frame becomes, where code2wav hands a chunk's audio on as soon as it is
    # decoded; None where audio lags the frames sent (then chunks are cut by size alone).
    seconds_per_frame: float | None

    def job_from_proto(self, start: stages_pb2.TalkerStart):
        """The engine job of a start message, checked against the model and the service's limits."""

    def input_from_proto(self, message: stages_pb2.TalkerInput) -> object | TextEnd:
        """A text input after start: the family's per-token payload, or the text's end (TextEnd)."""

    def text_rows_to_first_chunk(self, chunks: ChunkPolicy) -> int | None:
        """Text inputs the first chunk of `chunks` needs, or None when that is not known here."""
