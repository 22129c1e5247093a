"""Facts of the Qwen2.5-Omni model that more than one stage relies on (docs/qwen2_5-omni.md, sections
"What the talker needs from the thinker" and "Voices").

Checked against `Qwen2_5OmniForConditionalGeneration.generate` (transformers 5.19,
`models/qwen2_5_omni/modeling_qwen2_5_omni.py`). Plain functions of ids and configs: no torch
modules, no gRPC (the voices are read by checkpoint.load_voices).
"""

from __future__ import annotations

from services.base.errors import InvalidArgument
from services.base.families import DEFAULT_VOICES, Family

# generate's `talker_eos_token_id` default: codec pad and codec end of the real vocabulary (8448).
TALKER_EOS_IDS = (8292, 8294)
# generate's `speaker` default.
DEFAULT_VOICE = DEFAULT_VOICES[Family.QWEN2_5_OMNI]
# The talker prompt: every thinker prompt position, then the voice's bos token, then the first
# generated token's reply part (docs/qwen2_5-omni.md, section "The talker stage: prefill and the wait-for-reply rule").
TALKER_EXTRA_PREFILL = 2
# The 3 thinker embeddings the talker needs beside the reply parts, in this order.
TEXT_EMBEDS = ("voice_bos", "text_eos", "text_pad")


def talker_prompt_len(prompt_tokens: int) -> int:
    """Cache positions of the talker prefill for a thinker prompt of this many tokens."""
    return prompt_tokens + TALKER_EXTRA_PREFILL


def text_embed_ids(config, voice_bos_token: int) -> list[int]:
    """Thinker token ids of TEXT_EMBEDS: the voice's bos token, the talker's text eos and pad."""
    tc = config.talker_config
    return [int(voice_bos_token), int(tc.tts_text_end_token_id), int(tc.tts_text_pad_token_id)]


def resolve_voice(voices: dict[str, int], voice: str | None, field_name: str = "voice") -> tuple[str, int]:
    """A voice name (case-insensitive; None = generate's default) -> (its name in spk_dict.pt, bos token).
    `voices`: name -> bos token (checkpoint.voice_bos_tokens)."""
    by_lower = {name.lower(): name for name in voices}
    wanted = (voice or DEFAULT_VOICE).lower()
    if wanted not in by_lower:
        if voice is None:  # a checkpoint without generate's default voice: its first one
            name = next(iter(voices))
            return name, voices[name]
        raise InvalidArgument(field_name, f"unknown voice {voice!r}; known: {', '.join(sorted(voices))}")
    name = by_lower[wanted]
    return name, voices[name]


def audio_placeholders(mel_lengths):
    """Thinker prompt tokens per audio of these mel frame counts (Qwen2_5OmniProcessor: two
    stride-2 reductions). Works on ints and integer arrays alike."""
    return ((mel_lengths - 1) // 2 + 1 - 2) // 2 + 1
