"""What a request's inputs declare, read from their headers before anything is decoded.

A png/jpeg header states the image's size, a wav/flac header its length and rate; both are
checked against the limits before a pixel or sample is decoded, so a small file that declares
a huge image or a long recording costs nothing (a decompression bomb never expands). The same
declarations give each part's prompt tokens, so a request whose parts cannot fit the prompt
limit is refused before any of them is decoded, and a text whose UTF-8 size alone exceeds what
`max_prompt_tokens` tokens can spell (`max_token_bytes` each) before it is tokenized.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

from services.base.errors import InvalidArgument

MAX_AUDIO_RATE = 192_000  # Hz: the highest sample rate accepted
MAX_AUDIO_CHANNELS = 8
MAX_ASPECT_RATIO = 200  # Qwen2-VL's resize refuses anything longer than this
_OTHER_FORMATS = ((b"GIF8", "GIF"), (b"BM", "BMP"), (b"RIFF", "WEBP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers (every SOFn except DHT C4, JPG C8, DAC CC).
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def declared_image_size(data: bytes, field_name: str) -> tuple[int, int]:
    """(width, height) from a png's IHDR or a jpeg's start-of-frame, without decoding."""
    if data.startswith(_PNG_SIGNATURE):
        if len(data) < 24 or data[12:16] != b"IHDR":
            raise InvalidArgument(field_name, "not a readable png/jpeg image (no IHDR)")
        width, height = struct.unpack(">II", data[16:24])
        return width, height
    if data.startswith(b"\xff\xd8"):
        i = 2
        while i + 4 <= len(data):
            if data[i] != 0xFF:
                break
            marker = data[i + 1]
            if marker == 0xFF:  # fill byte
                i += 1
                continue
            if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
                i += 2
                continue
            (length,) = struct.unpack(">H", data[i + 2:i + 4])
            if marker in _SOF:
                if i + 9 > len(data):
                    break
                height, width = struct.unpack(">HH", data[i + 5:i + 9])
                return width, height
            if marker == 0xD9 or length < 2:
                break
            i += 2 + length
        raise InvalidArgument(field_name, "not a readable png/jpeg image (no frame header)")
    for magic, name in _OTHER_FORMATS:
        if data.startswith(magic) and (name != "WEBP" or data[8:12] == b"WEBP"):
            raise InvalidArgument(field_name, f"image format {name} is not png or jpeg")
    raise InvalidArgument(field_name, "not a readable png/jpeg image")


def check_image_size(width: int, height: int, field_name: str, max_pixels: int | None) -> None:
    if width <= 0 or height <= 0:
        raise InvalidArgument(field_name, f"image is {width}x{height} pixels")
    if max_pixels is not None and width * height > max_pixels:
        raise InvalidArgument(field_name, f"image has {width * height} pixels ({width}x{height}), more than {max_pixels}")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise InvalidArgument(field_name, f"image is {width}x{height}: aspect ratio over {MAX_ASPECT_RATIO}")


@dataclass(frozen=True)
class AudioHeader:
    frames: int  # per channel, as declared
    rate: int
    channels: int

    @property
    def seconds(self) -> float:
        return self.frames / self.rate


def declared_audio(data: bytes, field_name: str, max_seconds: float | None) -> AudioHeader:
    """The header of a wav/flac file, checked against the limits before any sample is decoded."""
    import soundfile as sf

    try:
        info = sf.info(io.BytesIO(data))
    except Exception as exc:  # soundfile raises several types for garbage input
        raise InvalidArgument(field_name, f"not a readable wav/flac file ({type(exc).__name__})") from None
    if info.format not in ("WAV", "WAVEX", "FLAC"):
        raise InvalidArgument(field_name, f"audio format {info.format} is not wav or flac")
    header = AudioHeader(int(info.frames), int(info.samplerate), int(info.channels))
    if not 0 < header.rate <= MAX_AUDIO_RATE:
        raise InvalidArgument(field_name, f"sample rate {header.rate} Hz is not in 1..{MAX_AUDIO_RATE}")
    if not 0 < header.channels <= MAX_AUDIO_CHANNELS:
        raise InvalidArgument(field_name, f"{header.channels} channels, not 1..{MAX_AUDIO_CHANNELS}")
    if max_seconds is not None and header.seconds > max_seconds:
        raise InvalidArgument(field_name, f"audio is {header.seconds:.1f} s, longer than {max_seconds} s")
    return header


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes one token can stand for (a bound: byte-level symbols count 2)."""
    return max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())


def text_byte_limit(max_prompt_tokens: int, token_bytes: int) -> int:
    """Text beyond this many UTF-8 bytes cannot fit in `max_prompt_tokens` tokens."""
    return max_prompt_tokens * token_bytes
