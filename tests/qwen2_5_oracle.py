"""The Qwen2.5-Omni engine tests' oracle: `ReferenceRunner` (services/tools/reference.py), i.e.
transformers' own `Qwen2_5OmniForConditionalGeneration.generate`, greedy, on inputs from
transformers' own `Qwen2_5OmniProcessor`, plus what the engine tests check beyond its result.

`generate_reference` records what generate hands its talker (`inputs_embeds` and
`thinker_reply_part` of `talker.generate`) and the talker's own codes, so the thinker engine's
payload can be checked against them bit for bit. Two changes to the runner's call, both inside
generate's talker and vocoder, never its thinker: `talker_eos_ids` replaces the talker's end ids
(generate cuts its codes at its own defaults, which the tiny checkpoint never emits; the tests cut
the recorded codes themselves, at the first of the ids they passed), and Token2Wav's forward
returns no audio (these tests compare ids; it costs about a second a call on the tiny checkpoint).

Also here: the requests the tests run (`CASES`), their media, and the engines' stages loaded as the
servers load them (`load_stage`), beside the runner's own copy of the model.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import Qwen2_5OmniForConditionalGeneration

from services.runtime.inputs.prompt import ChatMessage
from services.runtime.model.checkpoint import Stage, load_stage
from services.tools.reference import ReferenceRunner

# generate's own default talker end ids, read from transformers (not from the project's constant,
# services/runtime/qwen2_5_omni.TALKER_EOS_IDS, which the code under test uses and the tests check).
TALKER_EOS_IDS = tuple(inspect.signature(Qwen2_5OmniForConditionalGeneration.generate)
                       .parameters["talker_eos_token_id"].default)


@dataclass(frozen=True)
class Reference:
    token_ids: list[int]  # generated text ids
    codes: list[int]  # the talker's generated codec ids (end id included when emitted)
    talker_inputs_embeds: torch.Tensor  # [P + 2, H]: the talker's prompt embeds as generate builds them
    thinker_reply_part: torch.Tensor  # [T, H]: reply parts 1..T-2, text eos, text pad
    prompt_tokens: int


def generate_reference(runner: ReferenceRunner, messages: list[ChatMessage], voice: str, max_new_tokens: int,
                       talker_max_new_tokens: int, talker_eos_ids=TALKER_EOS_IDS) -> Reference:
    captured = {}
    model = runner.model
    talker_generate = model.talker.generate

    def capture(*args, **kwargs):
        captured["inputs_embeds"] = kwargs["inputs_embeds"][0].clone()  # before the forward touches it
        captured["thinker_reply_part"] = kwargs["thinker_reply_part"][0].clone()
        kwargs["eos_token_id"] = list(talker_eos_ids)
        captured["codes"] = talker_generate(*args, **kwargs)
        return captured["codes"]

    model.talker.generate = capture
    model.token2wav.forward = lambda codes, **kwargs: torch.zeros(0)  # no audio: see the module docstring
    try:
        result = runner.generate(messages, voice, max_new_tokens, talker_max_new_tokens)
    finally:
        del model.talker.generate
        del model.token2wav.forward
    return Reference(
        token_ids=result.thinker_token_ids, codes=captured["codes"][0, result.prompt_tokens + 2:].tolist(),
        talker_inputs_embeds=captured["inputs_embeds"], thinker_reply_part=captured["thinker_reply_part"],
        prompt_tokens=result.prompt_tokens,
    )


# The requests the exactness tests run: every modality (text, two audio clips, two image sizes,
# audio with an image), both voices, a system turn, texts shorter and longer than their speech.
# `join_step`: the engine step at which a request joins the batch.
@dataclass(frozen=True)
class Case:
    request_id: str
    prompt: str
    voice: str
    max_new_tokens: int  # thinker
    talker_max_new_tokens: int
    join_step: int
    audio: str | None = None  # a key of `media()`
    image: str | None = None
    system: str | None = None


CASES = [
    Case("text-ethan", "Hello there!", "Ethan", 8, 20, 0),
    Case("audio-chelsie", "What do you hear?", "Chelsie", 10, 16, 0, audio="sine"),
    Case("image-ethan", "Please describe the picture.", "Ethan", 7, 18, 1, image="noise"),
    Case("both-chelsie", "Look and listen.", "Chelsie", 9, 14, 1, audio="chirp", image="square"),
    Case("long-text-chelsie", "Once upon a time there was a small model that learned to talk.", "Chelsie", 16, 8, 2),
    Case("system-ethan", "Hi", "Ethan", 5, 24, 2, system="Answer briefly and speak clearly."),
    Case("chirp-ethan", "Tell me what you hear, please.", "Ethan", 12, 12, 3, audio="chirp"),
    Case("square-chelsie", "What is the weather like?", "Chelsie", 6, 20, 4, image="square"),
    Case("two-tokens-ethan", "The quick brown fox.", "Ethan", 2, 10, 5),
    Case("three-tokens-chelsie", "Numbers: 0 1 2 3", "Chelsie", 3, 15, 5, audio="sine"),
    Case("noise-sine-ethan", "Describe both.", "Ethan", 11, 9, 6, audio="sine", image="noise"),
    Case("text-chelsie", "How are you today?", "Chelsie", 14, 22, 7),
    Case("system-image-chelsie", "Colours?", "Chelsie", 8, 13, 8, image="noise", system="You are a helpful assistant."),
    Case("audio-long-text-ethan", "Please listen to the sound and tell me a story.", "Ethan", 15, 17, 9, audio="chirp"),
    Case("short-ethan", "Hello!", "Ethan", 4, 11, 11),
    Case("late-chelsie", "What do you hear? Please describe the picture.", "Chelsie", 10, 19, 14, audio="sine",
         image="square"),
]
BY_ID = {c.request_id: c for c in CASES}


def media() -> dict[str, tuple[str, bytes]]:
    """name -> (part kind, file bytes): two 16 kHz clips (1 s sine, 2.5 s chirp) and two images
    (48x64 and 40x40 pixels of seeded noise: different grids, different token counts)."""
    import io

    import numpy as np
    import soundfile as sf
    from PIL import Image

    def wav(samples) -> bytes:
        buf = io.BytesIO()
        sf.write(buf, samples.astype(np.float32), 16000, format="WAV", subtype="FLOAT")
        return buf.getvalue()

    def png(shape, seed: int) -> bytes:
        buf = io.BytesIO()
        pixels = np.random.default_rng(seed).integers(0, 256, size=(*shape, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, format="PNG")
        return buf.getvalue()

    t1, t2 = np.arange(16000) / 16000, np.arange(40000) / 16000
    return {
        "sine": ("audio", wav(0.5 * np.sin(2 * np.pi * 440 * t1))),
        "chirp": ("audio", wav(0.3 * np.sin(2 * np.pi * (200 + 300 * t2) * t2))),
        "noise": ("image", png((48, 64), 0)),
        "square": ("image", png((40, 40), 1)),
    }


def case_messages(case: Case, files: dict[str, tuple[str, bytes]]) -> list[ChatMessage]:
    from services.runtime.inputs.prompt import Part, Role

    parts = [Part(**{files[name][0]: files[name][1]}) for name in (case.audio, case.image) if name is not None]
    parts.append(Part(text=case.prompt))
    system = [ChatMessage(Role.SYSTEM, (Part(text=case.system),))] if case.system else []
    return system + [ChatMessage(Role.USER, tuple(parts))]


def load_engine_stages(folder) -> tuple:
    """(thinker, talker) modules as the servers load them, and the full config. The engines switch
    their modules' configs to the row-wise attention, so they never share the runner's copy."""
    thinker, talker = load_stage(folder, Stage.THINKER), load_stage(folder, Stage.TALKER)
    return thinker.model, talker.model, thinker.config
