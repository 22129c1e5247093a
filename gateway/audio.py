"""Audio in and out of the gateway: PCM conversion, and encoding through soundfile (libsndfile).

The pipeline's audio is float32 mono at 24 kHz. Every 16-bit output (pcm16 / pcm, wav, flac) is
that float audio rounded once, `int16 = clip(rint(x * 32768))`, so `int16 / 32768` gives the
gRPC path's samples back within one LSB (half an LSB unless clipped). mp3 and opus are lossy;
libsndfile encodes them. aac is refused: libsndfile has no AAC encoder and PyAV is not installed.
No codec is written here.
"""

from __future__ import annotations

import io

import numpy as np

SAMPLE_RATE = 24000

# OpenAI format name -> (libsndfile container, subtype); None = raw little-endian int16.
_SOUNDFILE = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}
MIME = {
    "wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg",
    "pcm": "audio/pcm", "pcm16": "audio/pcm", "aac": "audio/aac",
}
INPUT_FORMATS = ("wav", "mp3", "flac")


class UnsupportedFormat(ValueError):
    """A format the installed libraries cannot encode."""


def float_from_bytes(pcm: bytes) -> np.ndarray:
    """The wire's float32 little-endian PCM (omni.v1.AudioChunk.pcm) -> samples."""
    if len(pcm) % 4:
        raise ValueError(f"audio chunk has {len(pcm)} bytes, not a whole number of float32 samples")
    return np.frombuffer(pcm, dtype="<f4")


def to_int16(samples: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] -> int16, rounded once to nearest."""
    return np.clip(np.rint(np.asarray(samples, dtype=np.float64) * 32768.0), -32768, 32767).astype("<i2")


def pcm16_bytes(samples: np.ndarray) -> bytes:
    return to_int16(samples).tobytes()


def supported_output(fmt: str) -> bool:
    if fmt in ("pcm", "pcm16"):
        return True
    if fmt not in _SOUNDFILE:
        return False
    import soundfile as sf

    container, subtype = _SOUNDFILE[fmt]
    return container in sf.available_formats() and subtype in sf.available_subtypes(container)


def encode(samples: np.ndarray, fmt: str, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A whole clip in `fmt` (wav, flac, mp3, opus, pcm/pcm16)."""
    if fmt in ("pcm", "pcm16"):
        return pcm16_bytes(samples)
    if not supported_output(fmt):
        raise UnsupportedFormat(fmt)
    import soundfile as sf

    container, subtype = _SOUNDFILE[fmt]
    buf = io.BytesIO()
    if subtype == "PCM_16":
        # Our own rounding (see the module doc), handed over as int16 so libsndfile writes it as is.
        data = to_int16(samples)
    else:
        data = np.asarray(samples, dtype=np.float32)
    if data.size == 0:
        data = np.zeros(1, dtype=data.dtype)  # some encoders refuse an empty file
    sf.write(buf, data, sample_rate, format=container, subtype=subtype)
    return buf.getvalue()


def input_audio_to_wire(data: bytes, fmt: str) -> bytes:
    """An OpenAI `input_audio` part -> bytes the pipeline reads (wav or flac). wav and flac pass
    as they are; mp3 is decoded by libsndfile and handed on as a float wav of the decoded samples."""
    if fmt in ("wav", "flac"):
        return data
    import soundfile as sf

    samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=False)
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()
