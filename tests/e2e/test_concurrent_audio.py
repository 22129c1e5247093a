"""Audio under concurrency: each of 16 concurrent streams equals one vocoder forward of its own
frames, with the default incremental decoder and with the batched window decoder (`--decoder
window`, exact on the tiny vocoder, whose reach its 25 frames of left context cover).

code2wav decodes the chunks of all streams that are ready together, so a chunk given to the wrong
stream, a batch row mixed up or a context window taken from another request would show here as a
low SNR, while the ids-and-frames comparison (test_concurrency_exactness.py) would still pass."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from services.code2wav.vocoder import decode_full
from services.tools.client import build_request, collect, connect
from tests.stacks import stack_of

MIN_SNR_DB = 90.0  # as tests/e2e/test_pipeline_equals_reference.py
VOICES = ("ethan", "chelsie", "aiden")


def requests(wav_bytes, png_bytes):
    out = []
    for i in range(16):
        kind = ("text", "audio", "image")[i % 3]
        out.append(build_request(f"Stream {i}: say something" + " more" * (i % 4),
                                 audio=wav_bytes if kind == "audio" else None,
                                 image=png_bytes if kind == "image" else None, voice=VOICES[i % 3],
                                 max_new_tokens=4 + i % 5, talker_max_new_tokens=10 + (i * 11) % 37,
                                 return_codec_frames=True))
    return out


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    error = np.sum((reference.astype(np.float64) - test) ** 2)
    return float("inf") if error == 0 else 10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / error)


def assert_every_stream_equals_one_forward(omni, vocoder, all_requests):
    with ThreadPoolExecutor(max_workers=len(all_requests)) as pool:
        results = list(pool.map(lambda r: collect(omni, r, timeout=300), all_requests))
    lengths = set()
    for i, (request, got) in enumerate(zip(all_requests, results)):
        assert len(got.codec_frames) == request.talker_sampling.max_new_tokens - 1, i
        true_audio = decode_full(vocoder, torch.tensor(got.codec_frames))
        assert got.audio.shape == true_audio.shape, i
        assert np.sqrt(np.mean(true_audio ** 2)) > 0.01, i  # audible, so the comparison means something
        assert snr_db(true_audio, got.audio) > MIN_SNR_DB, f"stream {i}: {snr_db(true_audio, got.audio):.1f} dB"
        assert got.final.usage.audio_seconds == pytest.approx(true_audio.size / got.sample_rate), i
        lengths.add(true_audio.size)
    assert len(lengths) > 8  # streams of many lengths, so chunks of different streams meet in a batch


def test_sixteen_concurrent_streams_each_equal_one_vocoder_forward(omni, reference, wav_bytes, png_bytes):
    assert_every_stream_equals_one_forward(omni, reference.model.code2wav, requests(wav_bytes, png_bytes))


@pytest.fixture(scope="module")
def window_omni(tiny_checkpoint):
    with stack_of(tiny_checkpoint, code2wav_args=("--decoder", "window")) as stack:
        channel, stub = connect(stack.target)
        with channel:
            yield stub


@pytest.mark.slow  # a stack of its own: ~30 s on 2 cores
def test_the_batched_window_decoder_gives_each_of_sixteen_streams_one_vocoder_forward(
        window_omni, reference, wav_bytes, png_bytes):
    assert_every_stream_equals_one_forward(window_omni, reference.model.code2wav, requests(wav_bytes, png_bytes))
