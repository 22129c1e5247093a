"""A wav file of 16-bit mono samples, as the stdlib writes it: what the sessions service makes of a
realtime session's committed turn, and the gateway of a Realtime API input_audio part."""

from __future__ import annotations

import io
import wave


def wav_file(pcm: bytes, rate: int) -> bytes:
    """`pcm`, 16-bit little-endian mono samples at `rate` Hz, as a wav file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm)
    return buf.getvalue()
