"""Audio in and out of the gateway: PCM conversion, encoding through soundfile (libsndfile), and
streamed resampling through PyAV (libswresample).

The pipeline's audio is float32 mono at 24 kHz. Every 16-bit output (pcm16 / pcm, wav, flac) is
that float audio rounded once, `int16 = clip(rint(x * 32768))`, so `int16 / 32768` gives the
gRPC path's samples back within one LSB (half an LSB unless clipped). mp3 and opus are lossy;
libsndfile encodes them. aac is refused: libsndfile has no AAC encoder (PyAV's FFmpeg has one,
not wired here). No codec is written here.
"""

from __future__ import annotations

import io

import numpy as np

from services.base.resample import resample
from services.base.stages import SPEECH_SAMPLE_RATE

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
INPUT_SAMPLE_RATE = 16000  # what the thinker's Whisper feature extractor takes (services/runtime/inputs/media.py)
STREAMED_FORMATS = ("mp3", "opus", "wav")  # written progressively (StreamEncoder); flac is written whole
# MP3 written progressively is constant bit rate: with no LAME tag (it is written last, at the front,
# so a stream cannot carry it), decoders size a file from its first frame, exact only for CBR.
# libsndfile's compression level 0.5 at 24 kHz mono is 80 kbit/s (measured: 240-byte frames).
MP3_STREAM_LEVEL = 0.5


class UnsupportedFormat(ValueError):
    """A format the installed libraries cannot encode."""


def float_from_bytes(pcm: bytes) -> np.ndarray:
    """The wire's float32 little-endian PCM (omni.v1.AudioChunk.pcm) -> samples."""
    if len(pcm) % 4:
        raise ValueError(f"audio chunk has {len(pcm)} bytes, not a whole number of float32 samples")
    return np.frombuffer(pcm, dtype="<f4")


def joined(chunks: list[np.ndarray]) -> np.ndarray:
    """The chunks as one clip (none: an empty one)."""
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


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


def encode(samples: np.ndarray, fmt: str, sample_rate: int = SPEECH_SAMPLE_RATE) -> bytes:
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


class StreamResampler:
    """Float mono samples at `rate` -> float32 at `target`, chunk by chunk as one stream: libswresample's
    polyphase filter (through PyAV, pinned for video) keeps its history across chunks, so where the
    stream is cut changes no sample, and `flush()` gives the filter's tail, so the whole stream is
    round(n * target / rate) samples. Not thread-safe: one caller at a time."""

    def __init__(self, rate: int, target: int):
        import av  # FFmpeg's libraries load at the first resampled stream, not at the gateway's start

        self.rate = rate
        self.swr = av.AudioResampler(format="flt", layout="mono", rate=target)
        self.frame = av.AudioFrame.from_ndarray  # [1, n] float32 -> a frame

    def feed(self, samples: np.ndarray) -> np.ndarray:
        if not samples.size:
            return np.zeros(0, np.float32)
        frame = self.frame(np.asarray(samples, np.float32).reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = self.rate
        return self._joined(self.swr.resample(frame))

    def flush(self) -> np.ndarray:
        return self._joined(self.swr.resample(None))

    @staticmethod
    def _joined(frames) -> np.ndarray:
        return joined([frame.to_ndarray()[0] for frame in frames])


class AudioTooLong(ValueError):
    """Input audio over the gateway's limit (the thinker's --max-audio-seconds)."""


_DECODE_BLOCK = 1 << 16  # frames


def input_audio_to_wire(data: bytes, fmt: str, max_seconds: float | None = None) -> bytes:
    """An OpenAI `input_audio` part -> bytes the pipeline reads (wav or flac). wav and flac pass
    as they are (the thinker checks them). mp3 is decoded by libsndfile block by block, at most
    `max_seconds` of it (AudioTooLong past that), mixed to mono and resampled to 16 kHz as the
    thinker would, and handed on as a 16 kHz float wav: 64 kB a second whatever the mp3's rate
    (at 44.1 kHz stereo a float wav of the decoded samples was 353 kB a second, and 3 minutes of
    it passed gRPC's 64 MB limit)."""
    if fmt in ("wav", "flac"):
        return data
    import soundfile as sf

    blocks, frames = [], 0
    with sf.SoundFile(io.BytesIO(data)) as f:
        rate = f.samplerate
        cap = None if max_seconds is None else int(max_seconds * rate) + 1
        while cap is None or frames < cap:
            block = f.read(_DECODE_BLOCK if cap is None else min(_DECODE_BLOCK, cap - frames), dtype="float32",
                           always_2d=True)
            if block.shape[0] == 0:
                break
            blocks.append(block.mean(axis=1, dtype=np.float32))
            frames += block.shape[0]
    if max_seconds is not None and frames / rate > max_seconds:
        raise AudioTooLong(f"audio is longer than {max_seconds:g} s")
    samples = resample(np.concatenate(blocks) if blocks else np.zeros(0, np.float32), rate, INPUT_SAMPLE_RATE)
    buf = io.BytesIO()
    sf.write(buf, samples, INPUT_SAMPLE_RATE, format="WAV", subtype="FLOAT")
    return buf.getvalue()


class _Sink(io.RawIOBase):
    """The file libsndfile writes into: bytes appended at the end are handed out by `take()` as
    they come; what it rewrites later, at the front, once the length is known (a WAV header's
    sizes, MP3's LAME tag), is already sent and stays as first written."""

    def __init__(self):
        super().__init__()
        self.buf = bytearray()
        self.pos = 0
        self.sent = 0  # bytes of buf handed out

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.buf)}[whence]
        self.pos = base + offset
        return self.pos

    def read(self, size: int = -1) -> bytes:
        return b""  # libsndfile only reads back to probe; there is nothing to find

    def write(self, data) -> int:
        data = bytes(data)
        start, end = self.pos, self.pos + len(data)
        self.pos = end
        keep = max(start, self.sent)  # below `sent`: a rewrite of bytes already handed out, dropped
        if end > keep:
            self.buf[keep:end] = data[keep - start:]
        return len(data)

    def take(self) -> bytes:
        out = bytes(self.buf[self.sent:])
        self.sent = len(self.buf)
        return out


class StreamEncoder:
    """One clip encoded as it comes: `feed(samples)` returns the bytes libsndfile wrote for them (maybe
    none: encoders hold whole frames or pages), `finish()` the rest. mp3 (no LAME tag, see
    MP3_STREAM_LEVEL), Ogg/Opus (pages as they fill) and wav (its header's sizes 0xFFFFFFFF, the usual
    mark of a stream whose length is unknown: written before any sample). Not thread-safe: one
    caller at a time (the gateway runs each call in a worker thread, in order)."""

    def __init__(self, fmt: str, sample_rate: int = SPEECH_SAMPLE_RATE):
        if fmt not in STREAMED_FORMATS or not supported_output(fmt):
            raise UnsupportedFormat(fmt)
        import soundfile as sf

        container, subtype = _SOUNDFILE[fmt]
        self.fmt = fmt
        self.sink = _Sink()
        extra = {"bitrate_mode": "CONSTANT", "compression_level": MP3_STREAM_LEVEL} if fmt == "mp3" else {}
        self.file = sf.SoundFile(self.sink, "w", sample_rate, 1, format=container, subtype=subtype, **extra)
        self.fed = 0

    def feed(self, samples: np.ndarray) -> bytes:
        data = to_int16(samples) if self.fmt == "wav" else np.asarray(samples, dtype=np.float32)
        if data.size:
            self.file.write(data)
            self.fed += data.size
        return self._take()

    def finish(self) -> bytes:
        if self.fed == 0:
            self.file.write(np.zeros(1, np.int16 if self.fmt == "wav" else np.float32))  # some encoders refuse none
        self.file.close()
        return self._take()

    def _take(self) -> bytes:
        first = self.sink.sent == 0
        out = self.sink.take()
        if first and out and self.fmt == "wav":
            out = _streaming_wav_header(out)
        return out


def _streaming_wav_header(data: bytes) -> bytes:
    """The RIFF and data chunk sizes of a WAV's first bytes set to 0xFFFFFFFF (length unknown)."""
    out = bytearray(data)
    if out[:4] == b"RIFF":
        out[4:8] = b"\xff\xff\xff\xff"
        at = out.find(b"data", 12)
        if at >= 0 and at + 8 <= len(out):
            out[at + 4:at + 8] = b"\xff\xff\xff\xff"
    return bytes(out)
