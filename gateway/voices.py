"""OpenAI's voice names -> the checkpoint's own voices (docs/gateway.md has this table).

OpenAI's SDKs and apps send `alloy`, `nova`, ... ; Qwen3-Omni speaks as Chelsie, Ethan and Aiden
(Qwen2.5-Omni: Chelsie and Ethan). Each OpenAI name maps to the first of its choices that the
checkpoint has, by the voice's register as OpenAI describes it (female / male / neutral); a
checkpoint with none of them gets its default voice. A name the checkpoint itself has always wins,
so a checkpoint with a voice called `alloy` speaks as that voice.
"""

from __future__ import annotations

_FEMALE = ("chelsie",)
_MALE = ("ethan", "aiden")
_DEEP_MALE = ("aiden", "ethan")

# OpenAI voice -> the checkpoint voices it becomes, first match wins.
OPENAI_VOICES: dict[str, tuple[str, ...]] = {
    "alloy": _FEMALE,  # neutral, lighter
    "ash": _MALE,
    "ballad": _MALE,
    "cedar": _DEEP_MALE,
    "coral": _FEMALE,
    "echo": _MALE,
    "fable": _MALE,
    "marin": _FEMALE,
    "nova": _FEMALE,
    "onyx": _DEEP_MALE,
    "sage": _FEMALE,
    "shimmer": _FEMALE,
    "verse": _MALE,
}


def resolve_voice(name: str, voices: tuple[str, ...], default: str | None) -> str:
    """The checkpoint voice a request's `voice` names: itself if the checkpoint has it (or the
    checkpoint's voices are unknown here and it is no OpenAI name), else its OpenAI mapping."""
    voice = name.lower()
    if voice in voices or voice not in OPENAI_VOICES:
        return voice
    for choice in OPENAI_VOICES[voice]:
        if not voices or choice in voices:
            return choice
    return default or voice
