"""The streaming pipeline over four real processes equals transformers' generate (greedy)."""

from __future__ import annotations

import numpy as np
import pytest

from omni.v1 import common_pb2
from services.runtime.inputs.prompt import ChatMessage, Part, Role
from services.tools.client import build_request, collect
from tests.audio_checks import check_streamed_audio

pytestmark = pytest.mark.exactness

MAX_TEXT = 24
MAX_FRAMES_TOKENS = 60  # the talker's max new tokens: at most 59 frames

# Audio (streamed, and generate's) is checked against the float64 vocoder forward over all frames:
# exact length and at most 1 dB worse than the float32 forward (tests/audio_checks.py; a
# misaligned, missing or duplicated sample gives < 10 dB). Measured on the tiny checkpoint: see
# docs/qwen3-omni.md, "Float32 and float64".


def user_turn(prompt: str, audio: bytes | None = None, image: bytes | None = None) -> list[ChatMessage]:
    parts = [Part(audio=audio)] if audio else []
    parts += [Part(image=image)] if image else []
    return [ChatMessage(Role.SYSTEM, (Part(text="Answer briefly."),)),
            ChatMessage(Role.USER, tuple(parts) + (Part(text=prompt),))]


CASES = {
    "text": dict(prompt="Hello! How are you today?"),
    "audio": dict(prompt="What do you hear?", with_audio=True),
    "image": dict(prompt="Describe the picture.", with_image=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_text_ids_codec_frames_and_audio_equal_reference(case, omni, reference, wav_bytes, png_bytes,
                                                                   tiny_checkpoint):
    spec = CASES[case]
    audio = wav_bytes if spec.get("with_audio") else None
    image = png_bytes if spec.get("with_image") else None
    expected = reference.generate(user_turn(spec["prompt"], audio, image), voice="chelsie",
                                  max_new_tokens=MAX_TEXT, talker_max_new_tokens=MAX_FRAMES_TOKENS)

    request = build_request(spec["prompt"], system="Answer briefly.", audio=audio, image=image, voice="chelsie",
                            max_new_tokens=MAX_TEXT, talker_max_new_tokens=MAX_FRAMES_TOKENS,
                            return_codec_frames=True)
    got = collect(omni, request, timeout=120)

    assert got.thinker_token_ids == expected.thinker_token_ids
    assert got.text == expected.text
    assert got.codec_frames == expected.codec_frames
    assert len(got.codec_frames) == MAX_FRAMES_TOKENS - 1  # random weights never say codec EOS

    # The true answer: one float64 code2wav forward over all frames (generate's own audio is one
    # float32 forward below 300 frames: docs/qwen3-omni.md, "generate's audio past 300 frames").
    vocoder = reference.model.code2wav
    streamed = got.audio
    assert streamed.shape == expected.audio.shape
    check_streamed_audio(vocoder, expected.codec_frames, streamed)
    check_streamed_audio(vocoder, expected.codec_frames, expected.audio)
    assert np.sqrt(np.mean(streamed ** 2)) > 0.01  # audible, so the comparison means something
    assert len(got.audio_chunks) >= 3  # streamed: a small first chunk, then chunks of 25 frames
    assert got.final.usage.codec_frames == len(expected.codec_frames)
    assert got.final.usage.text_tokens == MAX_TEXT


def test_first_audio_arrives_before_the_last_text_delta_on_a_long_answer(omni):
    # ~1000 thinker steps take seconds; the first audio chunk needs the talker prefill, 4 frames and
    # one code2wav chunk (about 0.1 s here), so the margin survives a loaded machine.
    request = build_request("Tell me a long story.", max_new_tokens=1000, talker_max_new_tokens=30)
    got = collect(omni, request, timeout=120)
    # Long: on the tiny checkpoint greedy decoding says <|im_end|> after 602 tokens on this prompt
    # (STOP); the check allows any checkpoint that runs long, ending at its end token or the limit.
    tokens = len(got.thinker_token_ids)
    assert tokens >= 500, tokens
    assert got.final.text_finish_reason == (common_pb2.FINISH_REASON_LENGTH if tokens == 1000
                                            else common_pb2.FINISH_REASON_STOP)
    assert got.audio_times, "no audio came back"
    # Audio starts long before the text is done: within the first half of the text deltas, an
    # ordering of events (not a time bound), so a loaded machine slows both sides alike.
    before_audio = sum(t < got.audio_times[0] for t in got.text_times)
    assert before_audio < len(got.text_times) / 2, (before_audio, len(got.text_times))


def test_text_only_request_returns_no_audio(omni):
    request = build_request("Hello!", text_only=True, max_new_tokens=8)
    got = collect(omni, request, timeout=60)
    assert len(got.thinker_token_ids) == 8
    assert got.audio_chunks == []
    assert got.final.usage.codec_frames == 0
