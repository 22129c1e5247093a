"""Band-limited resampling, numpy only: the thinker's prompt building and the gateway (which holds
no model code) resample audio with this one function, so audio the gateway resamples is the audio
the thinker would have made."""

from __future__ import annotations

import numpy as np


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Zero-pad or truncate the spectrum (deterministic): [n] at `rate` -> [round(n*target/rate)]
    float32 at `target`."""
    if rate == target or samples.size == 0:
        return samples.astype(np.float32)
    n_out = max(1, int(round(samples.size * target / rate)))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    out = np.fft.irfft(spectrum, n=n_out) * (n_out / samples.size)
    return out.astype(np.float32)
