"""Qwen3-Omni's vocoder (`Qwen3OmniMoeCode2Wav`) as both decoders see it: its geometry and the
reference answer, one forward over all frames.

NOTE: geometry. The vocoder is causal: a causal sliding-window transformer, then left-padded
convolutions and transposed convolutions that trim the samples still waiting for the next
frame's overlap-add (docs/qwen3-omni.md, section "The vocoder": geometry and reach). A forward
over n frames returns n*U - L samples:

    U = samples_per_frame  (model.total_upsample, 1920 for the real layout)
    L = lookahead_samples  (555 for upsample_rates (8, 5, 4, 3): sum of each transposed conv's
                            stride times the upsampling after it, 8*60 + 5*12 + 4*3 + 3)

`measure_geometry` checks that affine length once at start-up; both decoders' bookkeeping (window.py,
incremental.py) relies on it: after the last frame, total emitted == n_total*U - L == len(decode_full).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.base.stages import SPEECH_SAMPLE_RATE

EMPTY = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class VocoderGeometry:
    samples_per_frame: int  # U
    lookahead_samples: int  # L: samples of a chunk that depend on later frames
    sample_rate: int  # 24000 (take from config if present, else 24000)

    @property
    def min_left_context(self) -> int:
        # Frames of context needed to regenerate the L samples held back at a chunk boundary.
        return -(-self.lookahead_samples // self.samples_per_frame)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def forward(model, frames: torch.Tensor) -> torch.Tensor:
    # frames [n, Q] int64, time-major -> codes [1, Q, n] -> wav [1, 1, n*U - L]
    # -> [n*U - L] float32, still on the model's device.
    return forward_batch(model, frames.unsqueeze(0))[0]


def forward_batch(model, windows: torch.Tensor) -> torch.Tensor:
    """windows [B, n, Q] (equal lengths) -> wav [B, n*U - L] float32: one vocoder forward."""
    codes = windows.to(device=model_device(model), dtype=torch.long).transpose(1, 2)  # [B, Q, n]
    with torch.inference_mode():
        wav = model(codes)
    return wav[:, 0].float()


def measure_geometry(model) -> VocoderGeometry:
    """U from the model, L from two dummy forwards; call once per model at start-up."""
    samples_per_frame = int(model.total_upsample)
    num_quantizers = int(model.config.num_quantizers)
    # Two sizes (2 and 3 frames, a few ms even on the real model) check that the output length
    # is affine, n*U - L, which the decoder's bookkeeping relies on.
    lookaheads = set()
    for n in (2, 3):
        dummy = torch.zeros((n, num_quantizers), dtype=torch.long)
        lookaheads.add(n * samples_per_frame - forward(model, dummy).shape[-1])
    if len(lookaheads) != 1:
        raise RuntimeError(
            f"vocoder output length is not n*U - L (U={samples_per_frame}, L in {sorted(lookaheads)})"
        )
    lookahead = lookaheads.pop()
    if not 0 <= lookahead < samples_per_frame:
        raise RuntimeError(f"implausible vocoder look-ahead L={lookahead} for U={samples_per_frame}")
    sample_rate = getattr(model.config, "sample_rate", None) or SPEECH_SAMPLE_RATE
    return VocoderGeometry(samples_per_frame, int(lookahead), int(sample_rate))


def decode_full(model, frames: torch.Tensor) -> np.ndarray:
    """The true answer: one forward over all frames [n, Q] -> float32 [n*U - L]."""
    if frames.shape[0] == 0:
        return EMPTY.copy()
    return forward(model, frames).cpu().numpy()
