"""The Realtime API's audio formats at the gateway's edge: `audio/pcm` (pcm16) at any rate from 8 to
48 kHz, and G.711 (`audio/pcmu` mu-law, `audio/pcma` A-law) at 8 kHz, each direction on its own.

In, nothing is resampled: the sessions service reads pcm16 at any rate in that range
(sessions/audio.py), so the gateway passes the declared rate through and only decodes G.711 to
pcm16 (gateway/g711.py). Out, the pipeline's 24 kHz float audio is resampled to the asked rate by
libswresample (gateway/audio.py's StreamResampler), rounded once to pcm16 as every gateway output
is, then G.711-encoded where asked. The bytes go out in whole base64 groups, so clients that join
the deltas' strings decode them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway import audio as audio_codec
from gateway import g711
from services.base.stages import SPEECH_SAMPLE_RATE

# The rates `audio/pcm` may declare: what the sessions service reads (sessions/audio.py MIN_RATE,
# MAX_RATE), and the outputs asked of the resampler.
MIN_RATE, MAX_RATE = 8000, 48000
LAWS = {"audio/pcmu": "pcmu", "audio/pcma": "pcma"}  # the G.711 types -> g711.py's names


class FormatError(ValueError):
    """A format or audio we do not take; `param` the field's name (under the format object for a format)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass(frozen=True)
class AudioFormat:
    type: str  # audio/pcm, audio/pcmu or audio/pcma
    rate: int  # samples a second: 8000 to 48000 for audio/pcm, 8000 for G.711

    @property
    def law(self) -> str | None:
        """The G.711 law (pcmu, pcma), None for pcm16."""
        return LAWS.get(self.type)

    @property
    def sample_bytes(self) -> int:
        return 1 if self.law else 2

    def shown(self) -> dict:
        """The format as session.created/updated show it."""
        return {"type": self.type} if self.law else {"type": self.type, "rate": self.rate}

    def pcm16(self, data: bytes, param: str) -> bytes:
        """Input in this format -> pcm16 at `rate` (G.711 decoded); FormatError naming `param` for
        a partial sample."""
        if len(data) % self.sample_bytes:
            raise FormatError(f"{len(data)} bytes is not a whole number of pcm16 samples", param)
        return g711.decode(data, self.law) if self.law else data


PCM24 = AudioFormat("audio/pcm", SPEECH_SAMPLE_RATE)  # the Realtime API's default both ways


def parse(fmt: dict) -> AudioFormat:
    """A format object's keys (checked by the caller) -> the format; FormatError with the field
    (`type` or `rate`) it refuses."""
    kind = fmt.get("type", "audio/pcm")
    if kind != "audio/pcm" and kind not in LAWS:
        raise FormatError(f"audio/pcm (pcm16, {MIN_RATE}-{MAX_RATE} Hz), audio/pcmu or audio/pcma (G.711, 8 kHz); "
                          f"{kind!r} is not served", "type", "unsupported")
    rate = fmt.get("rate")
    if kind in LAWS:
        if rate not in (None, g711.RATE):
            raise FormatError(f"must be {g711.RATE} for {kind}", "rate")
        return AudioFormat(kind, g711.RATE)
    if rate is None:
        return PCM24
    if not isinstance(rate, int) or isinstance(rate, bool) or not MIN_RATE <= rate <= MAX_RATE:
        raise FormatError(f"must be an integer in [{MIN_RATE}, {MAX_RATE}] Hz for audio/pcm, got {rate!r}", "rate")
    return AudioFormat(kind, rate)


class AudioOut:
    """One response's audio in `fmt`: the pipeline's 24 kHz float chunks in, the format's bytes out
    in whole base64 groups (3 bytes; 6 for pcm16: whole samples too), as if the reply were one
    array; `finish()` the rest."""

    def __init__(self, fmt: AudioFormat = PCM24):
        self.fmt = fmt
        self.group = 3 * fmt.sample_bytes
        self.resampler = None if fmt.rate == SPEECH_SAMPLE_RATE else audio_codec.StreamResampler(
            SPEECH_SAMPLE_RATE, fmt.rate)
        self.held = b""  # bytes of the last partial group

    def feed(self, samples: np.ndarray) -> bytes:
        return self._take(samples if self.resampler is None else self.resampler.feed(samples))

    def finish(self) -> bytes:
        data = self._take(np.zeros(0, np.float32) if self.resampler is None else self.resampler.flush())
        data, self.held = data + self.held, b""
        return data

    def _take(self, samples: np.ndarray) -> bytes:
        pcm = audio_codec.to_int16(samples)
        data = self.held + (g711.encode(pcm, self.fmt.law) if self.fmt.law else pcm.tobytes())
        cut = len(data) - len(data) % self.group
        self.held = data[cut:]
        return data[:cut]
