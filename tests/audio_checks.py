"""The audio criterion of every test that compares streamed audio: relative to float64, not a fixed dB.

Streamed audio is right when it is as close to the vocoder's float64 answer as the float32 forward
itself is (docs/qwen3-omni.md, "Float32 and float64"). A fixed bound against the float32 forward
only holds for narrow vocoders: on the tiny one the float32 forward is about 103 dB from float64,
on one with the real Qwen3-Omni widths (hidden 1024, decoder dim 1536, 8 layers, window 72) about
88 dB, while a dropped, duplicated or misplaced sample gives under 10 dB at any width.

    check_streamed_audio(model, frames, audio)

asserts that `audio` has exactly the vocoder's length for `frames` (n*U - L samples) and that
SNR(audio vs float64) >= SNR(float32 forward vs float64) - 1 dB, and returns both figures
(`start=s`: `audio` is the answer's samples from s on, one chunk of a stream).

The float64 reference is `copy.deepcopy(model).double()`, made once per model. transformers'
rotary embedding computes its angles in float32 even there (positions * inv_freq, both cast to
float), so it is the float64 forward of the same function: a decoder that rotates by the true
absolute positions (the incremental one) is compared like for like.
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from services.code2wav.vocoder import decode_full

# SNR(streamed vs float64) may fall this far below SNR(float32 forward vs float64).
MARGIN_DB = 1.0

_FLOAT64_TWINS: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class AudioCheck:
    float32_snr_db: float  # the float32 forward against the float64 one: float32 rounding
    streamed_snr_db: float  # the audio under test against the float64 forward
    truth: np.ndarray = field(repr=False, compare=False)  # the float64 forward's samples checked against


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-noise ratio of `test` against `reference`, in dB, computed in float64."""
    reference = np.asarray(reference, dtype=np.float64)
    error = np.sum((reference - np.asarray(test, dtype=np.float64)) ** 2)
    return math.inf if error == 0 else 10 * math.log10(np.sum(reference ** 2) / error)


def float64_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of the code2wav module, made on first use and kept while the model lives."""
    twin = _FLOAT64_TWINS.get(model)
    if twin is None:
        twin = copy.deepcopy(model).double().eval()
        _FLOAT64_TWINS[model] = twin
    return twin


def _as_frames(frames) -> torch.Tensor:
    frames = frames if isinstance(frames, torch.Tensor) else torch.tensor(frames)
    if frames.ndim != 2:
        raise ValueError(f"frames must be [n, num_quantizers], got {list(frames.shape)}")
    return frames.to(torch.long)


def decode_float64(model: torch.nn.Module, frames) -> np.ndarray:
    """One float64 vocoder forward over frames [n, Q] -> float64 [n*U - L]."""
    twin = float64_twin(model)
    codes = _as_frames(frames).to(next(twin.parameters()).device).t().unsqueeze(0)  # [1, Q, n]
    with torch.inference_mode():
        return twin(codes)[0, 0].cpu().numpy()


def check_streamed_audio(model: torch.nn.Module, frames, audio: np.ndarray, start: int = 0,
                         margin_db: float = MARGIN_DB) -> AudioCheck:
    """Assert that `audio` (streamed for codec frames [n, Q]) is the vocoder's answer for `frames`
    within float32 rounding: exact length, SNR vs float64 >= the float32 forward's - margin_db.

    `start`: `audio` holds the answer's samples [start, end) only (one chunk of a stream)."""
    frames = _as_frames(frames)
    audio = np.asarray(audio)
    truth = decode_float64(model, frames)
    float32 = decode_full(model, frames)
    assert float32.shape == truth.shape
    assert audio.ndim == 1 and start + audio.shape[0] == truth.shape[0], (
        f"length: audio {audio.shape} from sample {start}, one forward gives {truth.shape[0]} samples")
    truth, float32 = truth[start:], float32[start:]
    assert np.sum(truth ** 2) > 0, "the float64 forward is silent: SNR would mean nothing"
    check = AudioCheck(float32_snr_db=snr_db(truth, float32), streamed_snr_db=snr_db(truth, audio), truth=truth)
    assert check.streamed_snr_db >= check.float32_snr_db - margin_db, (
        f"audio is {check.streamed_snr_db:.1f} dB from the float64 forward, the float32 forward "
        f"{check.float32_snr_db:.1f} dB: more than {margin_db} dB worse than float32 rounding")
    return check
