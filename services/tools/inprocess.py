"""Driving the thinker and talker engines in one process, without gRPC: what the benchmark's
first-chunk floor and the engine tests do.

The handoff goes through the servers' own adapters, so there is one copy of it: the thinker's
adapter makes the stage messages the thinker service sends (`TalkerStart` at prefill, then the
`TalkerInput`s of each token), and the talker's adapter reads them as the talker service does,
checks included. Only the network is left out.
"""

from __future__ import annotations

from omni.v1 import omni_pb2, stages_pb2
from services.runtime.inputs.prompt import PromptBuilder, PromptInputs
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from services.serving.convert import sampling_to_proto
from services.talker.config import TalkerConfig
from services.talker.server import ADAPTERS as TALKER_ADAPTERS
from services.thinker.engine import ThinkerJob, Token
from services.thinker.server import ADAPTERS as THINKER_ADAPTERS


class Handoff:
    """One family's thinker -> talker handoff: its two engine classes, the thinker job of a request
    (with the voice where the family needs it there), the talker job made from the thinker's
    prefill event, and the talker inputs each generated token brings."""

    def __init__(self, prompts: PromptBuilder, config, talker_config: TalkerConfig | None = None):
        thinker, talker = THINKER_ADAPTERS[prompts.family], TALKER_ADAPTERS[prompts.family]
        self.thinker = thinker(prompts.folder, config, prompts)
        # The talker service's defaults (its limits and sampling defaults) unless told otherwise.
        self.talker = talker(config, talker_config or TalkerConfig(ServingConfig(), ModelConfig(prompts.folder)))
        self.thinker_engine, self.talker_engine, self.prefilled = thinker.engine, talker.engine, thinker.prefilled

    def thinker_job(self, prompt: PromptInputs, sampling: SamplingConfig, voice: str | None = None,
                    talker: bool = True) -> ThinkerJob:
        return self.thinker.job(prompt, sampling, talker, (), self.thinker.resolve_voice(voice) if talker else None)

    def talker_job(self, prefilled, job: ThinkerJob, sampling: SamplingConfig, voice: str | None = None):
        """The talker's job for a request the thinker has prefilled: the start message the thinker
        service would send, read as the talker service reads it."""
        request = omni_pb2.GenerateRequest(talker_sampling=sampling_to_proto(sampling))
        if voice is not None:
            request.voice = voice
        start = self.thinker.talker_start(request, stages_pb2.Route(), prefilled, job)
        return self.talker.job_from_proto(start)

    def talker_inputs(self, token: Token, previous_id: int | None = None) -> list:
        """The talker's inputs for one generated token (`previous_id`: the token before it)."""
        return [self.talker.input_from_proto(message) for message in self.thinker.talker_inputs(token, previous_id)]
