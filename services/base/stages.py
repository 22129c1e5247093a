"""The names of the pipeline's stages, one enum for every place that says which stage it is.

A `StrEnum`, so a member is its name wherever a string goes (metric labels, LoadReport.stage,
log lines, error messages) and comparing with the wire's string form stays exact.
"""

from __future__ import annotations

import enum


class Stage(enum.StrEnum):
    THINKER = "thinker"  # the LLM: text tokens and the hidden states the talker reads
    TALKER = "talker"  # the codec LM: 16-codebook (Qwen2.5: 1-codebook) audio frames
    CODE2WAV = "code2wav"  # the vocoder: frames to 24 kHz audio


# The rate of the speech code2wav emits, in both families (Qwen3-Omni's code2wav and Qwen2.5-Omni's
# BigVGAN): what the wire's audio chunks carry, and what a reader assumes before the first one.
SPEECH_SAMPLE_RATE = 24000
