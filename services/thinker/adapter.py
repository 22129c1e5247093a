"""What the thinker server needs of a model family: one adapter per family, picked once at start
(server.ADAPTERS, by the checkpoint's model_type), so the servicer has no family branches.

Qwen3-Omni's is qwen3_adapter.py, Qwen2.5-Omni's qwen2_5_adapter.py. An adapter knows the
family's engine class, how a request's voice reaches the engines, how long the talker's prompt is,
and how the engine's talker-bound events become stage messages (stages.proto: `TalkerStart` and
`TalkerInput`).
"""

from __future__ import annotations

from typing import Protocol

from omni.v1 import omni_pb2, stages_pb2
from services.runtime.inputs.prompt import PromptInputs
from services.runtime.lm.sampling import SamplingConfig
from services.thinker.engine import ThinkerJob, Token


class ThinkerAdapter(Protocol):
    engine: type  # the engine class: (model, config, device=, engine_config=)
    cuda_graphs: bool  # False: not implemented for the family; the server decodes eagerly
    prefilled: type  # the engine's prefill event that carries the talker's payload

    def resolve_voice(self, voice: str | None):
        """A request's voice (None: the family's default) -> what `job` takes; InvalidArgument("voice")
        if the checkpoint has no such voice."""

    def talker_prompt_len(self, prompt: PromptInputs) -> int:
        """Cache positions the talker's prefill of this prompt takes."""

    def job(self, prompt: PromptInputs, sampling: SamplingConfig, audio: bool, forced_ids: tuple[int, ...],
            voice) -> ThinkerJob:
        """The engine job (`voice`: `resolve_voice`'s answer; None without audio)."""

    def end_token_id(self) -> int:
        """The thinker's <|im_end|>: what ends a forced text."""

    def talker_start(self, req: omni_pb2.GenerateRequest, route: stages_pb2.Route, event,
                     job: ThinkerJob) -> stages_pb2.TalkerStart:
        """The talker stream's first message, from the `prefilled` event."""

    def talker_inputs(self, event: Token, previous_id: int | None) -> list[stages_pb2.TalkerInput]:
        """What the talker gets for one generated token (`previous_id`: the token before it); after
        the last token this includes the text-finished mark."""
