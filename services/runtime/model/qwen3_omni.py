"""Facts of the Qwen3-Omni model that more than one stage relies on (docs/qwen3-omni.md).

Only plain functions of token ids and the model config live here: no torch modules, no gRPC.
"""

from __future__ import annotations

import math

from services.base.stages import SPEECH_SAMPLE_RATE

# The vocoder's output rate where its config names none.

# Positions of the talker prefill after the user-turn positions: text rows <|im_start|>,
# `assistant`, `\n`, 4 x tts_pad, tts_bos, the first generated token, summed with codec rows
# [0, 0, 0, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos] (docs/qwen3-omni.md,
# section "The talker prefill").
TALKER_ASSISTANT_PREFILL = 9


def talker_prompt_len(prompt_token_ids: list[int], config) -> int:
    """Cache positions of the talker prefill: every user-turn position plus 9 assistant ones.
    A position's role is the token after the last <|im_start|> at or before it (as generate)."""
    last_start, user = 0, 0
    for i, token in enumerate(prompt_token_ids):
        if token == config.im_start_token_id:
            last_start = i
        user += prompt_token_ids[min(last_start + 1, len(prompt_token_ids) - 1)] == config.user_token_id
    return user + TALKER_ASSISTANT_PREFILL


def seconds_per_frame(code2wav_config) -> float:
    """The audio one codec frame becomes: the vocoder's total upsampling over its sample rate
    (80 ms for the real layout: 8 * 5 * 4 * 3 * 2 * 2 = 1920 samples at 24 kHz)."""
    samples = math.prod(code2wav_config.upsample_rates) * math.prod(code2wav_config.upsampling_ratios)
    return samples / (getattr(code2wav_config, "sample_rate", None) or SPEECH_SAMPLE_RATE)
