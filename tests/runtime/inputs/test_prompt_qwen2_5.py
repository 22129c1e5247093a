"""PromptBuilder for Qwen2.5-Omni: the inputs transformers' own Qwen2_5OmniProcessor makes.

The family's differences from Qwen3-Omni sit in `AudioRules`: the feature extractor pads every
audio to its 30 s window (cutting longer audio to it) and an audio gets
((frames - 1) // 2 + 1 - 2) // 2 + 1 tokens; its chat template comes from the checkpoint like
Qwen3-Omni's. On the tiny checkpoint (`omni-tiny-checkpoint --family qwen2_5_omni`).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from services.runtime.inputs.limits import declared_audio
from services.runtime.inputs.prompt import ChatMessage, Part, PromptBuilder, Role
from services.runtime.model.qwen2_5_omni import audio_placeholders
from services.tools.reference import oracle_inputs, oracle_processor


def wav(seconds: float, rate: int = 16000) -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.4 * np.sin(2 * np.pi * 330 * t)).astype(np.float32), rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


@pytest.fixture(scope="module")
def config(tiny_qwen2_5_checkpoint):
    from transformers import Qwen2_5OmniConfig

    return Qwen2_5OmniConfig.from_pretrained(tiny_qwen2_5_checkpoint)


@pytest.fixture(scope="module")
def builder(tiny_qwen2_5_checkpoint, config) -> PromptBuilder:
    return PromptBuilder(tiny_qwen2_5_checkpoint, config)


@pytest.fixture(scope="module")
def processor(tiny_qwen2_5_checkpoint):
    return oracle_processor(tiny_qwen2_5_checkpoint)


def user(*parts: Part) -> list[ChatMessage]:
    return [ChatMessage(Role.USER, tuple(parts))]


@pytest.mark.exactness
@pytest.mark.parametrize("content", ["text", "audio", "image", "audio+image", "two audios", "system"])
def test_inputs_equal_the_processors(builder, processor, wav_bytes, png_bytes, content):
    parts = {"text": [], "audio": [Part(audio=wav_bytes)], "image": [Part(image=png_bytes)],
             "audio+image": [Part(audio=wav(2.5)), Part(image=png_bytes)],
             "two audios": [Part(audio=wav_bytes), Part(audio=wav(3.3))], "system": []}[content]
    messages = user(*parts, Part(text="What is this?"))
    if content == "system":
        messages = [ChatMessage(Role.SYSTEM, (Part(text="Answer briefly."),))] + messages
    ours = builder.build(messages).model_kwargs()
    theirs = oracle_inputs(processor, messages)
    assert set(ours) == set(theirs) - {"video_second_per_grid"}
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key


def test_the_chat_template_is_the_checkpoints(builder, tiny_qwen2_5_checkpoint):
    # The tiny checkpoint's template renders only the messages given (no default system turn).
    assert builder.chat_template == (tiny_qwen2_5_checkpoint / "chat_template.jinja").read_text()
    inputs = builder.build(user(Part(text="hi")))
    assert builder.decode(inputs.input_ids[0].tolist()) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    system = [ChatMessage(Role.SYSTEM, (Part(text="Be brief."),))] + user(Part(text="hi"))
    assert builder.decode(builder.build(system).input_ids[0].tolist()) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_audio_is_padded_to_the_30_s_window_with_one_token_per_4_frames(builder, config, wav_bytes):
    inputs = builder.build(user(Part(audio=wav_bytes), Part(text="hi")))
    assert inputs.input_features.shape == (1, 128, 3000)  # the extractor's window, as the processor pads
    assert int(inputs.feature_attention_mask.sum()) == 100  # 1 s at a 10 ms hop
    assert (inputs.input_ids == config.thinker_config.audio_token_index).sum() == 25 == audio_placeholders(100)


def test_audio_longer_than_the_window_is_cut_to_it_as_the_processor_does(builder, processor, config):
    messages = user(Part(audio=wav(31.0)), Part(text="hi"))
    inputs = builder.build(messages)
    assert int(inputs.feature_attention_mask.sum()) == 3000
    assert (inputs.input_ids == config.thinker_config.audio_token_index).sum() == audio_placeholders(3000) == 750
    assert torch.equal(inputs.input_ids, oracle_inputs(processor, messages)["input_ids"])


@pytest.mark.parametrize("seconds", [0.05, 1.0, 2.5, 29.9, 45.0])
def test_declared_audio_tokens_are_a_lower_bound(builder, config, seconds):
    data = wav(seconds)
    at_least = builder.audio_tokens_at_least(declared_audio(data, "x", None))
    actual = int((builder.build(user(Part(audio=data))).input_ids == config.thinker_config.audio_token_index).sum())
    assert at_least <= actual <= at_least + 1
