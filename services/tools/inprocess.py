"""Driving the thinker and talker engines in one process, without gRPC: what the benchmark's
first-chunk floor and the engine tests do. The services do the same over the wire
(services/thinker/server.py sends `TalkerStart`; services/talker/server.py reads it)."""

from __future__ import annotations

from services.runtime.prompt import PromptInputs
from services.runtime.sampling import SamplingConfig
from services.talker.engine import TalkerJob
from services.thinker.engine import Prefilled


def talker_job(prefilled: Prefilled, prompt: PromptInputs, speaker_id: int, sampling: SamplingConfig) -> TalkerJob:
    """The talker's job for a request the thinker has prefilled (what crosses the boundary at
    prefill: docs/qwen3-omni.md)."""
    return TalkerJob(
        prompt_token_ids=prefilled.prompt_token_ids, prompt_embeds=prefilled.prompt_embeds,
        multimodal_positions=prefilled.multimodal_positions, multimodal_hidden=prefilled.multimodal_hidden,
        tts_embeds=prefilled.tts_embeds, speaker_id=speaker_id, sampling=sampling,
        image_grid_thw=prompt.image_grid_thw, audio_feature_lengths=prompt.audio_feature_lengths,
    )
