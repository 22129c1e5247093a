"""What the hostile-input tests share: the stack's limits, raw calls, process memory, hostile files."""

from __future__ import annotations

import io
import struct
import zlib

import grpc

from services.serving.grpc_server import channel_options

MAX_AUDIO_SECONDS = 10.0  # the thinker's --max-audio-seconds
MAX_IMAGE_PIXELS = 64 * 64  # the thinker's --max-image-pixels
MAX_IN_FLIGHT = 16  # the router's admission limit
SETTLE_S = 5.0  # time every in-flight count gets to return to 0
POLL_DEADLINE_S = 1.0  # the router's health-poll deadline (services/serving/replicas.py)


def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} for {pid}")


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc."""
    return _status_kb(pid, "VmRSS")


class PeakRss:
    """The highest resident memory a process reaches while the block runs, above what it had when
    the block started: the kernel's own high-water mark (VmHWM, reset at the start by writing 5 to
    /proc/PID/clear_refs), counted at the source, so no spike between two samples is missed."""

    def __init__(self, pid: int):
        self.pid = pid
        self.start = self.peak = 0

    def __enter__(self) -> PeakRss:
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS (Linux >= 4.0)
        self.start = rss_bytes(self.pid)
        self.peak = _status_kb(self.pid, "VmHWM")
        return self

    def __exit__(self, *exc) -> None:
        self.peak = _status_kb(self.pid, "VmHWM")

    @property
    def growth(self) -> int:
        return self.peak - self.start


def raw_channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=channel_options())


def raw_call(channel: grpc.Channel, method: str, body: bytes, streaming_request: bool, timeout: float = 30):
    """Send `body` unparsed to `method`; returns (code, details, error or None, response count)."""
    responses = 0
    try:
        if streaming_request:
            call = channel.stream_stream(method)(iter([body]), timeout=timeout)
        else:
            call = channel.unary_stream(method)(body, timeout=timeout)
        for _ in call:
            responses += 1
        return grpc.StatusCode.OK, "", None, responses
    except grpc.RpcError as err:
        return err.code(), err.details() or "", err, responses


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_declaring(width: int, height: int, rows: int | None = None) -> bytes:
    """A grayscale png that declares width x height; its data holds `rows` zero rows (all of them
    by default: a valid image that compresses to almost nothing, a decompression bomb)."""
    rows = height if rows is None else rows
    compress = zlib.compressobj(9)
    row = b"\x00" * (width + 1)  # filter byte + pixels
    data = b"".join(compress.compress(row) for _ in range(rows)) + compress.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", data) + _png_chunk(b"IEND", b"")


def flac_of_silence(seconds: float, rate: int = 48000) -> bytes:
    """A flac file of `seconds` of silence: a few hundred KB however long it is."""
    import numpy as np
    import soundfile as sf

    buf = io.BytesIO()
    block = np.zeros(rate * 10, dtype=np.int16)
    with sf.SoundFile(buf, "w", samplerate=rate, channels=1, format="FLAC", subtype="PCM_16") as f:
        left = int(seconds * rate)
        while left > 0:
            f.write(block[:min(left, block.size)])
            left -= block.size
    return buf.getvalue()


def wav_of(seconds: float, rate: int = 16000) -> bytes:
    import numpy as np
    import soundfile as sf

    buf = io.BytesIO()
    t = np.arange(int(round(seconds * rate))) / rate
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()
