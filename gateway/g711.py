"""G.711 at 8 kHz, the telephony audio of the Realtime API's `audio/pcmu` (mu-law) and `audio/pcma`
(A-law): one byte a sample, converted here to and from the pcm16 the sessions service takes, with
numpy. The companding is the reference algorithm (ITU-T G.711 as Sun's g711.c writes it),
vectorized: decoding is a 256-entry table, encoding the segment search per sample.

The pipeline speaks at 24 kHz: `Downsampler` takes a reply's chunks to 8 kHz as one stream (a
low-pass filter whose history carries across chunks, then every third sample), so chunk edges
leave no clicks.
"""

from __future__ import annotations

import numpy as np

from services.base.stages import SPEECH_SAMPLE_RATE

RATE = 8000
LAWS = ("pcmu", "pcma")
_ULAW_SEGMENTS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEGMENTS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _ulaw_to_linear(codes: np.ndarray) -> np.ndarray:
    u = ~codes.astype(np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84)


def _alaw_to_linear(codes: np.ndarray) -> np.ndarray:
    a = codes.astype(np.int32) ^ 0x55
    seg = (a & 0x70) >> 4
    t = ((a & 0x0F) << 4) + np.where(seg == 0, 8, 0x108)
    t = np.where(seg > 1, t << np.maximum(seg - 1, 0), t)
    return np.where(a & 0x80, t, -t)


_CODES = np.arange(256)
_DECODE = {"pcmu": _ulaw_to_linear(_CODES).astype("<i2"), "pcma": _alaw_to_linear(_CODES).astype("<i2")}


def decode(data: bytes, law: str) -> bytes:
    """G.711 bytes (`law`: pcmu or pcma) -> pcm16 little-endian, sample for sample."""
    return _DECODE[law][np.frombuffer(data, np.uint8)].tobytes()


def encode(samples: np.ndarray, law: str) -> bytes:
    """int16 samples -> G.711 bytes (`law`: pcmu or pcma)."""
    x = samples.astype(np.int32)
    if law == "pcmu":
        x >>= 2
        mask = np.where(x < 0, 0x7F, 0xFF)
        x = np.minimum(np.abs(x), 8159) + 0x21
        seg = np.searchsorted(_ULAW_SEGMENTS, x)
        code = np.where(seg >= 8, 0x7F, (seg << 4) | ((x >> (np.minimum(seg, 7) + 1)) & 0x0F))
    else:
        x >>= 3
        mask = np.where(x >= 0, 0xD5, 0x55)
        x = np.where(x >= 0, x, -x - 1)
        seg = np.searchsorted(_ALAW_SEGMENTS, x)
        shift = np.where(seg < 2, 1, np.minimum(seg, 7))
        code = np.where(seg >= 8, 0x7F, (seg << 4) | ((x >> shift) & 0x0F))
    return (code ^ mask).astype(np.uint8).tobytes()


def _lowpass(taps: int = 63, cutoff_hz: float = 3600.0, rate: int = SPEECH_SAMPLE_RATE) -> np.ndarray:
    """A windowed-sinc low-pass (Blackman) below 8 kHz's Nyquist, unit gain at DC."""
    n = np.arange(taps) - (taps - 1) / 2
    h = np.sinc(2 * cutoff_hz / rate * n) * np.blackman(taps)
    return (h / h.sum()).astype(np.float32)


class Downsampler:
    """24 kHz float samples -> 8 kHz, chunk by chunk, as if the reply were one array."""

    TAPS = _lowpass()

    def __init__(self):
        self.history = np.zeros(len(self.TAPS) - 1, np.float32)  # the last input samples, the filter's memory
        self.phase = 0  # where in this chunk the next kept sample is (every third of the stream)

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        stream = np.concatenate([self.history, samples.astype(np.float32)])
        filtered = np.convolve(stream, self.TAPS, "valid")  # one per input sample of this chunk
        self.history = stream[len(stream) - len(self.history):]
        kept = filtered[self.phase::3]
        self.phase = (self.phase - len(samples)) % 3
        return kept
