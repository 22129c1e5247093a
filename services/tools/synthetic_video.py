"""Synthetic videos (PyAV encoding moving random pixels and a tone): the tests' and the bench's
video prompts, made where they are used, no downloads."""

from __future__ import annotations

import io

import numpy as np


def video(frames: int = 12, width: int = 64, height: int = 48, fps: int = 6, container: str = "mp4",
          codec: str | None = None, audio_seconds: float | None = None, audio_rate: int = 16000,
          seed: int = 0, flat: bool = False, options: dict | None = None, last_at_s: float | None = None,
          audio_codec: str | None = None) -> bytes:
    """An mp4 (h264 + aac) or webm (vp9 + opus) of moving random pixels (`flat`: one grey, which
    compresses to almost nothing at any size); with `audio_seconds`, a tone track. `options`: the
    muxer's (e.g. movflags=faststart: the index before the data). `last_at_s`: the last frame's
    timestamp (a video of two frames can declare hours). `audio_codec` "vorbis" (webm): FFmpeg's
    own Vorbis encoder (stereo only, the same tone in both channels), which, unlike Opus (always
    decoded at 48 kHz), decodes at the rate it was written at."""
    import av

    codec = codec or {"mp4": "libx264", "webm": "libvpx-vp9"}[container]
    rng = np.random.default_rng(seed)
    base = (np.full((height, width, 3), 128, dtype=np.uint8) if flat
            else rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container, options=options or {}) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p" if codec != "mjpeg" else "yuvj420p"
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "crf": "18"}
        track = None
        if audio_seconds is not None:
            audio_codec = audio_codec or {"mp4": "aac", "webm": "libopus"}[container]
            track = out.add_stream(audio_codec, rate=audio_rate)
            track.layout = "stereo" if audio_codec == "vorbis" else "mono"
            if audio_codec == "vorbis":
                track.codec_context.options = {"strict": "experimental"}
        for i in range(frames):
            pixels = np.roll(base, shift=3 * i, axis=1)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            if last_at_s is not None and i == frames - 1:
                frame.pts = int(last_at_s * fps)  # the stream's time base is 1 / fps
            elif last_at_s is not None:
                frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
        if track is not None:
            _write_tone(out, track, audio_seconds, audio_rate, audio_codec)
    return buf.getvalue()


def _write_tone(out, track, seconds: float, rate: int, codec: str) -> None:
    """A 440 Hz tone growing louder, `seconds` long, into the audio track (vorbis: the same in two
    planar channels)."""
    import av

    n = int(seconds * rate)
    t = np.arange(n) / rate
    samples = (0.3 * np.sin(2 * np.pi * 440 * t) * (1 + t)).astype(np.float32)[None]
    layout, fmt = "mono", "flt"
    if codec == "vorbis":
        samples, layout, fmt = np.repeat(samples, 2, axis=0), "stereo", "fltp"
    step = 1024
    for start in range(0, n, step):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, start:start + step]), format=fmt, layout=layout)
        frame.sample_rate = rate
        out.mux(track.encode(frame))
    out.mux(track.encode())


def frame_images(frames: int = 12, width: int = 64, height: int = 48, seed: int = 0) -> tuple[bytes, ...]:
    """The same moving random pixels as `video`, as png files (a video given as its frames)."""
    from PIL import Image

    base = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = []
    for i in range(frames):
        buf = io.BytesIO()
        Image.fromarray(np.roll(base, shift=3 * i, axis=1)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return tuple(out)
