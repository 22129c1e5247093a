"""The window decoder (--decoder window): chunked push()+finish() equals one vocoder forward over all frames.

The criterion (tests/audio_checks.py): exact length, and SNR against the float64 forward close
to the float32 forward's. Measured on the tiny checkpoint (seed 0), 60 random frames (generator
seed 1234), left_context 25, float32 on CPU: the float32 forward is 103.2 dB from float64;
streamed at chunk 1, 4 and 25: 103.1 dB, mixed 4/25/25/6: 102.4 dB. The residual is float
rounding, not the algorithm (a missing or misplaced sample gives < 10 dB). This decoder rotates
by window-relative RoPE positions, exact in exact arithmetic but rounded differently from one
forward's absolute ones, so it gets 2 dB of margin instead of 1 (160 frames: 101.6-102.0 dB
against 103.6 dB); the incremental decoder (test_incremental.py) keeps absolute positions and
is held to 1 dB.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.code2wav.blocks import BlockGrid, StreamDecoder
from services.code2wav.vocoder import VocoderGeometry, decode_full, measure_geometry
from services.code2wav.window import WindowVocoder
from services.runtime.model.checkpoint import Stage, load_stage
from services.tools.tiny_checkpoint import build
from tests.audio_checks import check_streamed_audio, snr_db

N_FRAMES = 60


def window_decoder(model, geometry, left_context: int = 25, size: int = 4) -> StreamDecoder:
    return StreamDecoder(WindowVocoder(model, geometry, BlockGrid((size,)), left_context))
# See the module docstring: window-relative rotary positions round differently.
WINDOW_MARGIN_DB = 2.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = build(tmp_path_factory.mktemp("tiny_checkpoint"), 0)
    return load_stage(folder, Stage.CODE2WAV).model


@pytest.fixture(scope="module")
def geometry(model) -> VocoderGeometry:
    return measure_geometry(model)


@pytest.fixture(scope="module")
def frames(model) -> torch.Tensor:
    # [N_FRAMES, Q] int64, time-major.
    cfg = model.config
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, cfg.codebook_size, (N_FRAMES, cfg.num_quantizers), generator=gen)


@pytest.fixture(scope="module")
def reference(model, frames) -> np.ndarray:
    return decode_full(model, frames)


def stream(model, geometry, frames, schedule: list[int], left_context: int = 25) -> np.ndarray:
    assert sum(schedule) == frames.shape[0]
    decoder = window_decoder(model, geometry, left_context=left_context)
    pieces, start = [], 0
    for size in schedule:
        pieces.append(decoder.push(frames[start : start + size]))
        start += size
    pieces.append(decoder.finish())
    assert decoder.frames_seen == frames.shape[0]
    assert decoder.samples_emitted == sum(len(p) for p in pieces)
    return np.concatenate(pieces)


def even_schedule(chunk: int, total: int = N_FRAMES) -> list[int]:
    return [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])


def test_geometry_is_derived_from_the_model(model, geometry, frames):
    U, L = geometry.samples_per_frame, geometry.lookahead_samples
    assert U == int(model.total_upsample)
    assert 0 < L < U
    assert geometry.sample_rate == 24000
    for n in (1, 7):
        assert len(decode_full(model, frames[:n])) == n * U - L


@pytest.mark.parametrize("chunk", [1, 4, 25])
def test_chunked_stream_equals_one_full_forward(model, geometry, frames, reference, chunk):
    out = stream(model, geometry, frames, even_schedule(chunk))
    assert out.dtype == np.float32 and out.ndim == 1
    assert len(out) == len(reference) == N_FRAMES * geometry.samples_per_frame - geometry.lookahead_samples
    check_streamed_audio(model, frames, out, margin_db=WINDOW_MARGIN_DB)


def test_mixed_chunk_schedule_equals_one_full_forward(model, geometry, frames, reference):
    schedule = [4, 25, 25, N_FRAMES - 54]
    out = stream(model, geometry, frames, schedule)
    assert len(out) == len(reference)
    check_streamed_audio(model, frames, out, margin_db=WINDOW_MARGIN_DB)


def test_first_push_of_four_frames_already_returns_audio(model, geometry, frames):
    U, L = geometry.samples_per_frame, geometry.lookahead_samples
    decoder = window_decoder(model, geometry)
    first = decoder.push(frames[:4])
    assert len(first) == 4 * U - L
    # The vocoder is causal: the first 4*U - L samples of the whole answer are those of frames[:4].
    check_streamed_audio(model, frames[:4], first, margin_db=WINDOW_MARGIN_DB)
    # The next chunk first releases the L samples held back at the boundary, then its own.
    second = decoder.push(frames[4:8])
    assert len(second) == 4 * U
    check_streamed_audio(model, frames[:8], second, start=len(first), margin_db=WINDOW_MARGIN_DB)


def test_context_window_stays_bounded(model, geometry, frames):
    decoder = window_decoder(model, geometry, left_context=25)
    for size in even_schedule(10):
        decoder.push(frames[decoder.frames_seen : decoder.frames_seen + size])
        assert decoder.stream._frames.shape[0] <= 25 + 4  # the context and the open block


def test_too_little_left_context_is_measurably_worse(model, geometry, frames, reference):
    # Seen here (chunk 4): left_context 1 -> 2.6 dB, 20 -> 32.6 dB, 24 and 25 -> 103 dB. The tiny
    # vocoder reaches back ~24 frames (2 sliding-window layers of 8 plus the convolutions).
    schedule = even_schedule(4)
    exact = snr_db(reference, stream(model, geometry, frames, schedule, left_context=25))
    for left_context in (1, 20):
        short = stream(model, geometry, frames, schedule, left_context=left_context)
        assert len(short) == len(reference)
        assert snr_db(reference, short) < exact


def test_left_context_below_one_frame_is_rejected(model, geometry):
    # 0 frames of context cannot regenerate the L samples held back at each block boundary.
    with pytest.raises(ValueError):
        WindowVocoder(model, geometry, BlockGrid((4,)), left_context=0)
