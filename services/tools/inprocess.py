"""Driving the thinker and talker engines in one process, without gRPC: what the benchmark's
first-chunk floor and the engine tests do. The services do the same over the wire
(services/thinker/server.py sends `TalkerStart`; services/talker/server.py reads it).

A `Handoff` is one family's part of that: its two engine classes, the thinker job of a request
(with the voice the family needs there), the talker job made from the thinker's prefill event, and
the talker inputs each generated token brings. `handoff_for` picks the checkpoint's.
"""

from __future__ import annotations

from pathlib import Path

from services.runtime import qwen2_5_omni
from services.runtime.checkpoint import voice_bos_tokens
from services.runtime.families import Family
from services.runtime.prompt import PromptInputs, resolve_voice
from services.runtime.sampling import SamplingConfig
from services.talker.engine import TalkerEngine, TalkerJob, TextEnd, TextRow
from services.talker.qwen2_5 import Qwen2_5TalkerEngine, Qwen2_5TalkerJob, ReplyPart
from services.thinker.engine import Prefilled, ThinkerEngine, ThinkerJob, Token
from services.thinker.qwen2_5 import Qwen2_5Prefilled, Qwen2_5ThinkerEngine, Qwen2_5ThinkerJob


def talker_job(prefilled: Prefilled, prompt: PromptInputs, speaker_id: int, sampling: SamplingConfig) -> TalkerJob:
    """The talker's job for a request the thinker has prefilled (what crosses the boundary at
    prefill: docs/qwen3-omni.md)."""
    return TalkerJob(
        prompt_token_ids=prefilled.prompt_token_ids, prompt_embeds=prefilled.prompt_embeds,
        multimodal_positions=prefilled.multimodal_positions, multimodal_hidden=prefilled.multimodal_hidden,
        tts_embeds=prefilled.tts_embeds, speaker_id=speaker_id, sampling=sampling,
        image_grid_thw=prompt.image_grid_thw, audio_feature_lengths=prompt.audio_feature_lengths,
        video_grid_thw=prompt.video_grid_thw, video_second_per_grid=prompt.video_second_per_grid,
    )


class Qwen3Handoff:
    """Qwen3-Omni: the voice is the talker's speaker id; each token but the last brings a text row."""

    thinker_engine = ThinkerEngine
    talker_engine = TalkerEngine
    prefilled = Prefilled

    def __init__(self, folder: str | Path, config, voice: str | None):
        _, self.speaker_id = resolve_voice(config, voice)

    def thinker_job(self, prompt: PromptInputs, sampling: SamplingConfig, talker: bool = True) -> ThinkerJob:
        return ThinkerJob(prompt, sampling, talker)

    def talker_job(self, prefilled: Prefilled, prompt: PromptInputs, sampling: SamplingConfig) -> TalkerJob:
        return talker_job(prefilled, prompt, self.speaker_id, sampling)

    @staticmethod
    def talker_inputs(token: Token) -> list:
        return [TextEnd() if token.last else TextRow(token.embedding)]


class Qwen2_5Handoff:
    """Qwen2.5-Omni: the voice is the thinker's (its bos token, spk_dict.pt); token i + 1 brings
    token i's reply part, the last token also the text's end
    (docs/qwen2_5-omni.md, section "What crosses the thinker -> talker boundary")."""

    thinker_engine = Qwen2_5ThinkerEngine
    talker_engine = Qwen2_5TalkerEngine
    prefilled = Qwen2_5Prefilled

    def __init__(self, folder: str | Path, config, voice: str | None):
        _, self.voice_bos_token = qwen2_5_omni.resolve_voice(voice_bos_tokens(folder), voice)

    def thinker_job(self, prompt: PromptInputs, sampling: SamplingConfig, talker: bool = True) -> Qwen2_5ThinkerJob:
        return Qwen2_5ThinkerJob(prompt, sampling, talker, voice_bos_token=self.voice_bos_token)

    def talker_job(self, prefilled: Qwen2_5Prefilled, prompt: PromptInputs, sampling: SamplingConfig) -> Qwen2_5TalkerJob:
        return Qwen2_5TalkerJob(prefilled.prompt_hidden, prefilled.text_embeds, sampling)

    @staticmethod
    def talker_inputs(token: Token) -> list:
        return ([ReplyPart(token.reply)] if token.reply is not None else []) + ([TextEnd()] if token.last else [])


HANDOFFS = {Family.QWEN3_OMNI: Qwen3Handoff, Family.QWEN2_5_OMNI: Qwen2_5Handoff}


def handoff_for(family: Family, folder: str | Path, config, voice: str | None) -> Qwen3Handoff | Qwen2_5Handoff:
    return HANDOFFS[family](folder, config, voice)
