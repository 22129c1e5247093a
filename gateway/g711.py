"""G.711 at 8 kHz, the telephony audio of the Realtime API's `audio/pcmu` (mu-law) and `audio/pcma`
(A-law): one byte a sample, converted here to and from the pcm16 the sessions service takes, with
numpy. The companding is the reference algorithm (ITU-T G.711 as Sun's g711.c writes it),
vectorized: decoding is a 256-entry table, encoding the segment search per sample. The reply's
24 kHz audio reaches 8 kHz through the gateway's resampler (gateway/realtime_audio.py).
"""

from __future__ import annotations

import numpy as np

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
