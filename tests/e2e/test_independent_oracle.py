"""The pipeline against an oracle that shares no input code with it.

`ReferenceRunner` builds generate's inputs with transformers' own `Qwen3OmniMoeProcessor`
(chat template, Whisper features, Qwen2-VL patches, placeholder expansion: services/tools/reference.py
says how it is constructed without torchvision); the thinker service builds them with the project's
`PromptBuilder`. So a wrong template application, feature extraction, placeholder count or image
patching in the pipeline shows up here as different input ids / features, or as different text ids
and codec frames from the real stack. The conversations are multi-turn, with system and assistant
turns and several audios and images in one message.
"""

from __future__ import annotations

import io

import grpc
import numpy as np
import pytest
import torch

from omni.v1 import omni_pb2
from services.code2wav.vocoder import decode_full
from services.runtime.inputs.prompt import ChatMessage, Part, PromptBuilder, Role
from services.tools.client import build_request, collect

pytestmark = pytest.mark.exactness

MIN_SNR_DB = 90.0  # as tests/e2e/test_pipeline_equals_reference.py
ROLES = {Role.SYSTEM: omni_pb2.ROLE_SYSTEM, Role.USER: omni_pb2.ROLE_USER, Role.ASSISTANT: omni_pb2.ROLE_ASSISTANT}


def wav(seconds: float, hz: float, channels: int = 1, rate: int = 16000) -> bytes:
    import soundfile as sf

    t = np.arange(int(rate * seconds)) / rate
    samples = np.stack([0.4 * np.sin(2 * np.pi * hz * (c + 1) * t) for c in range(channels)], axis=1)
    buf = io.BytesIO()
    sf.write(buf, samples.astype(np.float32), rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def image(height: int, width: int, seed: int, fmt: str = "PNG") -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def conversations() -> dict[str, list[ChatMessage]]:
    # Audio lengths on both sides of the encoder's 100-mel-frame chunk (n_window * 2), a stereo file,
    # images that are resized up, down and to a non-square grid, a jpeg; media before, between and
    # after text.
    S, U, A = Role.SYSTEM, Role.USER, Role.ASSISTANT
    return {
        "multi_turn_text": [
            ChatMessage(S, (Part(text="You are a helpful voice assistant."),)),
            ChatMessage(U, (Part(text="Hello! How are you today?"),)),
            ChatMessage(A, (Part(text="I am fine, thank you."),)),
            ChatMessage(U, (Part(text="What is the weather like?"),)),
        ],
        "two_audios_two_images_one_message": [
            ChatMessage(S, (Part(text="Answer briefly."),)),
            ChatMessage(U, (Part(audio=wav(1.0, 440)), Part(text="and"), Part(image=image(48, 64, 1)),
                            Part(audio=wav(2.53, 220, channels=2)), Part(image=image(100, 30, 2, "JPEG")),
                            Part(text="Please describe the picture."))),
        ],
        "media_in_every_user_turn_with_assistant_turns": [
            ChatMessage(S, (Part(text="Answer briefly."),)),
            ChatMessage(U, (Part(image=image(20, 20, 3)), Part(text="Please describe the picture."))),
            ChatMessage(A, (Part(text="A small picture."),)),
            ChatMessage(U, (Part(text="Please listen to the sound."), Part(audio=wav(0.37, 330)))),
            ChatMessage(A, (Part(text="A tone."), Part(text=" Once upon a time."))),
            ChatMessage(U, (Part(audio=wav(1.21, 550)), Part(image=image(64, 48, 4)), Part(text="And now?"))),
        ],
    }


def as_request(messages: list[ChatMessage], voice: str, max_new_tokens: int, talker_max_new_tokens: int):
    request = omni_pb2.GenerateRequest(return_codec_frames=True, voice=voice)
    for message in messages:
        turn = request.messages.add(role=ROLES[message.role])
        for part in message.parts:
            if part.text is not None:
                turn.content.add(text=part.text)
            elif part.audio is not None:
                turn.content.add(audio=part.audio)
            else:
                turn.content.add(image=part.image)
    request.output_modalities.extend([omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO])
    request.thinker_sampling.max_new_tokens = max_new_tokens
    request.talker_sampling.max_new_tokens = talker_max_new_tokens
    return request


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    error = np.sum((reference.astype(np.float64) - test) ** 2)
    return float("inf") if error == 0 else 10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / error)


@pytest.mark.parametrize("case", sorted(conversations()))
def test_pipeline_prompt_inputs_equal_transformers_processor(case, reference, tiny_checkpoint):
    messages = conversations()[case]
    oracle = reference.inputs(messages)
    built = PromptBuilder(tiny_checkpoint, reference.config).build(messages).model_kwargs()
    assert sorted(built) == sorted(oracle)
    for key, value in oracle.items():
        assert built[key].shape == value.shape, key
        assert torch.equal(built[key].to(value.dtype), value), key
    # The conversation really has what the case claims (every turn and every medium expanded).
    ids = oracle["input_ids"][0].tolist()
    cfg = reference.config
    assert ids.count(cfg.im_start_token_id) == len(messages) + 1  # + the generation prompt
    n_audio = sum(p.audio is not None for m in messages for p in m.parts)
    n_image = sum(p.image is not None for m in messages for p in m.parts)
    assert ids.count(cfg.thinker_config.audio_start_token_id) == n_audio
    assert ids.count(cfg.thinker_config.vision_start_token_id) == n_image
    assert len(oracle.get("image_grid_thw", [])) == n_image


@pytest.mark.parametrize("case", sorted(conversations()))
def test_pipeline_equals_generate_on_processor_inputs(case, omni, reference):
    messages = conversations()[case]
    voice = {"multi_turn_text": "ethan", "two_audios_two_images_one_message": "chelsie"}.get(case, "aiden")
    expected = reference.generate(messages, voice=voice, max_new_tokens=12, talker_max_new_tokens=40)
    got = collect(omni, as_request(messages, voice, 12, 40), timeout=180)

    assert got.thinker_token_ids == expected.thinker_token_ids
    assert got.text == expected.text
    assert got.codec_frames == expected.codec_frames
    assert len(got.codec_frames) == 39
    assert got.final.usage.prompt_tokens == expected.prompt_tokens
    true_audio = decode_full(reference.model.code2wav, torch.tensor(expected.codec_frames))
    assert got.audio.shape == true_audio.shape == expected.audio.shape
    assert snr_db(true_audio, got.audio) > MIN_SNR_DB
    assert snr_db(expected.audio, got.audio) > MIN_SNR_DB


@pytest.mark.parametrize("layout", ["chat_template.json", "chat_template.jinja"])
def test_a_processor_chat_template_wins_over_the_tokenizers_as_in_transformers(layout, tiny_checkpoint, tmp_path):
    # Found by this oracle: PromptBuilder read only the tokenizer's template, so a checkpoint that
    # carries its template as the processor's file (the legacy chat_template.json, or
    # chat_template.jinja) got no template or the wrong one. Here the tokenizer's template differs
    # (a marker in every turn), so only the processor's file gives the oracle's inputs.
    import json
    import shutil

    from services.tools.reference import oracle_processor

    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "config.json"):
        shutil.copy(tiny_checkpoint / name, folder / name)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    template = tokenizer_config["chat_template"]
    tokenizer_config["chat_template"] = template.replace("'<|im_end|>\\n'", "'#MARK#<|im_end|>\\n'")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if layout == "chat_template.json":
        (folder / layout).write_text(json.dumps({"chat_template": template}))
    else:
        (folder / layout).write_text(template)

    from transformers import AutoConfig

    messages = conversations()["multi_turn_text"]
    processor = oracle_processor(folder)
    oracle = processor.apply_chat_template(
        [{"role": m.role.value, "content": [{"type": "text", "text": p.text} for p in m.parts]} for m in messages],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    built = PromptBuilder(folder, AutoConfig.from_pretrained(folder)).build(messages)
    assert "#MARK#" not in processor.tokenizer.decode(oracle["input_ids"][0])
    assert torch.equal(built.input_ids, oracle["input_ids"])


@pytest.mark.parametrize("token", ["<|audio_pad|>", "<|image_pad|>"])
def test_a_media_placeholder_typed_as_text_is_invalid_argument(token, omni, reference, wav_bytes):
    # Found beside the oracle: transformers' processor cannot build such a prompt (it expands every
    # placeholder it finds, text or not), while the pipeline served a text-only one (a media pad
    # position with no media behind it) and failed with an AssertionError while expanding one
    # beside real audio.
    with pytest.raises(Exception):  # noqa: B017 - StopIteration or a shape error, transformers' choice
        reference.inputs([ChatMessage(Role.USER, (Part(audio=wav_bytes), Part(text=f"and {token} here")))])
    for request in (build_request(f"say {token} now", max_new_tokens=4, talker_max_new_tokens=5),
                    build_request(f"and {token} here", audio=wav_bytes, max_new_tokens=4, talker_max_new_tokens=5)):
        with pytest.raises(grpc.RpcError) as info:
            collect(omni, request, timeout=60)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        text_part = len(request.messages[0].content) - 1
        assert f"messages[0].content[{text_part}].text" in info.value.details(), info.value.details()
        assert token in info.value.details()
