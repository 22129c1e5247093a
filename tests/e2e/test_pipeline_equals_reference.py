"""The streaming pipeline over four real processes equals transformers' generate (greedy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.code2wav.streaming import decode_full
from services.runtime.prompt import ChatMessage, Part, Role
from services.tools.client import build_request, collect

MAX_TEXT = 24
MAX_FRAMES_TOKENS = 60  # the talker's max new tokens: at most 59 frames

# Streamed audio against one code2wav forward over all frames. Measured on the tiny checkpoint:
# 103-107 dB (float32 rounding of the rotary positions inside each decode window), so 90 dB
# leaves margin while catching any misaligned, missing or duplicated sample (those give < 10 dB).
MIN_SNR_DB = 90.0


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    error = np.sum((reference.astype(np.float64) - test) ** 2)
    return float("inf") if error == 0 else 10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / error)


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

    # The true answer: one code2wav forward over all frames (equals generate's audio below 300 frames).
    true_audio = decode_full(reference.model.code2wav, torch.tensor(expected.codec_frames))
    streamed = got.audio
    assert streamed.shape == true_audio.shape == expected.audio.shape
    assert snr_db(true_audio, streamed) > MIN_SNR_DB
    assert snr_db(expected.audio, streamed) > MIN_SNR_DB
    assert np.sqrt(np.mean(streamed ** 2)) > 0.01  # audible, so the comparison means something
    assert len(got.audio_chunks) >= 3  # streamed: a small first chunk, then chunks of 25 frames
    assert got.final.usage.codec_frames == len(expected.codec_frames)
    assert got.final.usage.text_tokens == MAX_TEXT


def test_first_audio_arrives_before_the_last_text_delta_on_a_long_answer(omni):
    # ~1000 thinker steps take seconds; the first audio chunk needs the talker prefill, 4 frames and
    # one code2wav chunk (about 0.1 s here), so the margin survives a loaded machine.
    request = build_request("Tell me a long story.", max_new_tokens=1000, talker_max_new_tokens=30)
    got = collect(omni, request, timeout=120)
    assert len(got.thinker_token_ids) > 300  # long (random weights may say <|im_end|> after a few hundred)
    assert got.audio_times, "no audio came back"
    assert got.audio_times[0] < got.text_times[-1]


def test_text_only_request_returns_no_audio(omni):
    request = build_request("Hello!", text_only=True, max_new_tokens=8)
    got = collect(omni, request, timeout=60)
    assert len(got.thinker_token_ids) == 8
    assert got.audio_chunks == []
    assert got.final.usage.codec_frames == 0
