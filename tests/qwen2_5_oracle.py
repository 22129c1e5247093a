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
        # refuses (not a forward argument); the talker never reads them (docs/qwen2_5-omni.md).
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
