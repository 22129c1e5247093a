"""The oracle for the Qwen2.5-Omni engines: transformers' own `Qwen2_5OmniForConditionalGeneration
.generate` (greedy thinker and talker) on inputs from transformers' own `Qwen2_5OmniProcessor`.

It shares no input code with the pipeline (services/runtime/prompt.py): the processor renders the
chat template and expands the placeholders itself. Its video processor needs torchvision, which
does not import beside the CPU torch wheel, so it gets the same never-called stand-in as the
Qwen3-Omni oracle (services/tools/reference.py, `NoVideo`).

Besides the text ids and codec ids, `generate_reference` records what generate hands its talker
(`inputs_embeds` and `thinker_reply_part` of `talker.generate`), so the thinker engine's payload
can be checked against them bit for bit. The one change to generate: the image pixels it passes
on to the talker are dropped there (a transformers bug: with them the talker's generate raises).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.runtime.prompt import ChatMessage
from services.tools.reference import NoVideo, oracle_conversation


@dataclass(frozen=True)
class Reference:
    token_ids: list[int]  # generated text ids
    codes: list[int]  # the talker's generated codec ids (end id included when emitted)
    talker_inputs_embeds: torch.Tensor  # [P + 2, H]: the talker's prompt embeds as generate builds them
    thinker_reply_part: torch.Tensor  # [T, H]: reply parts 1..T-2, text eos, text pad
    prompt_tokens: int


def oracle_processor(folder: str | Path):
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer, Qwen2_5OmniProcessor

    class ProcessorWithoutVideo(Qwen2_5OmniProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    image_processor = AutoImageProcessor.from_pretrained(str(folder))
    processor_dict, _ = Qwen2_5OmniProcessor.get_processor_dict(str(folder))
    return ProcessorWithoutVideo(
        image_processor=image_processor, video_processor=NoVideo(image_processor.merge_size),
        feature_extractor=AutoFeatureExtractor.from_pretrained(str(folder)), tokenizer=tokenizer,
        chat_template=processor_dict.get("chat_template") or tokenizer.chat_template,
    )


def oracle_inputs(processor, messages: list[ChatMessage]) -> dict:
    out = processor.apply_chat_template(oracle_conversation(messages), add_generation_prompt=True, tokenize=True,
                                        return_dict=True, return_tensors="pt")
    return dict(out)


def generate_reference(model, processor, messages: list[ChatMessage], voice: str, max_new_tokens: int,
                       talker_max_new_tokens: int, talker_eos_ids, repetition_penalty: float = 1.05) -> Reference:
    inputs = oracle_inputs(processor, messages)
    captured = {}
    talker_generate = model.talker.generate

    def capture(*args, **kwargs):
        # transformers quirk: generate hands the talker the image pixels too, which its generate
        # refuses (not a forward argument); the talker never reads them (docs/qwen2_5-omni-stages.md).
        kwargs.pop("pixel_values", None)
        kwargs.pop("pixel_values_videos", None)
        captured["inputs_embeds"] = kwargs["inputs_embeds"].clone()  # before the forward touches it
        captured["thinker_reply_part"] = kwargs["thinker_reply_part"].clone()
        captured["codes"] = talker_generate(*args, **kwargs)
        return captured["codes"]

    model.talker.generate = capture
    try:
        with torch.inference_mode():
            sequences, _ = model.generate(
                **inputs, speaker=voice, thinker_max_new_tokens=max_new_tokens, thinker_do_sample=False,
                talker_max_new_tokens=talker_max_new_tokens, talker_do_sample=False,
                talker_eos_token_id=list(talker_eos_ids), talker_repetition_penalty=repetition_penalty,
            )
    finally:
        del model.talker.generate
    prompt_tokens = int(inputs["input_ids"].shape[1])
    return Reference(
        token_ids=sequences[0, prompt_tokens:].tolist(),
        codes=captured["codes"][0, prompt_tokens + 2:].tolist(),
        talker_inputs_embeds=captured["inputs_embeds"][0], thinker_reply_part=captured["thinker_reply_part"][0],
        prompt_tokens=prompt_tokens,
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
    from services.runtime.prompt import Part, Role

    parts = [Part(**{files[name][0]: files[name][1]}) for name in (case.audio, case.image) if name is not None]
    parts.append(Part(text=case.prompt))
    system = [ChatMessage(Role.SYSTEM, (Part(text=case.system),))] if case.system else []
    return system + [ChatMessage(Role.USER, tuple(parts))]


def load_models(folder):
    """(reference model, engine model): two copies of the checkpoint. The engines switch their
    modules' configs to the row-wise attention, so the oracle runs on a copy of its own."""
    import transformers
    from transformers import Qwen2_5OmniForConditionalGeneration

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return tuple(Qwen2_5OmniForConditionalGeneration.from_pretrained(str(folder)).eval() for _ in range(2))
    finally:
        transformers.logging.set_verbosity(verbosity)
