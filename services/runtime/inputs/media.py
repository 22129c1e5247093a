"""A prompt's media: wav/flac and png/jpeg bytes decoded (their declared size checked before a sample
or pixel is), and the processors run over a prompt's decoded media (features, pixels and how many
placeholder tokens each gets). How a family's processor treats audio is one small object,
`AudioRules` (`Qwen3OmniMoeProcessor` vs `Qwen2_5OmniProcessor`); images are the same Qwen2-VL
processor in both. Videos are decoded by services/runtime/inputs/video.py.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from services.base.errors import InvalidArgument
from services.base.families import Family
from services.base.resample import resample
from services.runtime.inputs.limits import AudioHeader, check_image_size, declared_audio, declared_image_size
from services.runtime.model.qwen2_5_omni import audio_placeholders

AUDIO_SAMPLE_RATE = 16000  # what the Whisper feature extractor expects
MEL_HOP = 160  # samples per mel frame of the Whisper feature extractor


def audio_output_lengths(mel_lengths: np.ndarray, n_window: int) -> np.ndarray:
    """Audio encoder output positions for mel frame counts (as the processor computes it)."""
    chunk = n_window * 2
    leave = mel_lengths % chunk
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (mel_lengths // chunk) * 13


@dataclass(frozen=True)
class AudioRules:
    """How a family's processor turns audio into features and prompt tokens."""

    feature_kwargs: dict  # the feature extractor call's keywords beside rate, mask and tensor type
    tokens: Callable[[np.ndarray], np.ndarray]  # mel frames per audio -> prompt tokens per audio
    at_least: Callable[[int], int]  # mel frames an audio declares -> prompt tokens it yields, at least
    # The fewest 16 kHz samples the longest audio of a prompt may hold: the extractor pads every
    # audio to the longest one (or to its window), then its STFT reflect-pads n_fft / 2 samples on
    # each side, which needs more samples than that (fewer: torch's RuntimeError, in transformers'
    # own processor too, so no oracle has an answer to match).
    min_samples: int = 1


def audio_rules(family: Family, config, feature_extractor) -> AudioRules:
    if family is Family.QWEN2_5_OMNI:
        # Qwen2_5OmniProcessor pads to the extractor's 30 s window, which also cuts longer audio to
        # it (the extractor truncates by default), and counts two stride-2 reductions of the frames.
        window = int(feature_extractor.nb_max_frames)
        return AudioRules({"padding": "max_length"}, audio_placeholders,
                          lambda frames: int(audio_placeholders(min(frames, window))))
    n_window = config.thinker_config.audio_config.n_window
    return AudioRules({"padding": True, "truncation": False},
                      lambda mel_lengths: audio_output_lengths(mel_lengths, n_window),
                      lambda frames: int(frames // (n_window * 2)) * 13,  # whole encoder chunks
                      min_samples=int(feature_extractor.n_fft) // 2 + 1)  # padded to the longest audio only


def decode_audio(data: bytes, field_name: str, max_seconds: float | None = None,
                 header: AudioHeader | None = None) -> np.ndarray:
    """wav/flac bytes -> mono float32 at 16 kHz; InvalidArgument naming the field otherwise.

    The header is checked first (`declared_audio`: length, rate, channels); then at most the
    declared frames, and never more than `max_seconds`, are decoded, block by block, mixed down
    to mono as they come (a file holding fewer samples than it declares yields what it holds)."""
    import soundfile as sf

    header = header or declared_audio(data, field_name, max_seconds)
    # A stream that does not declare its length (frames 0) is read up to the limit.
    declared = header.frames if header.frames > 0 else None
    cap = None if max_seconds is None else int(max_seconds * header.rate) + 1
    limit = min(n for n in (declared, cap, 1 << 62) if n is not None)
    blocks, frames = [], 0
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            while frames < limit:
                block = f.read(min(_AUDIO_BLOCK_FRAMES, limit - frames), dtype="float32", always_2d=True)
                if block.shape[0] == 0:
                    break
                blocks.append(block.mean(axis=1))
                frames += block.shape[0]
    except Exception as exc:  # soundfile raises several types for garbage input
        raise InvalidArgument(field_name, f"not a readable wav/flac file ({type(exc).__name__})") from None
    if frames == 0:
        raise InvalidArgument(field_name, "audio has no samples")
    if max_seconds is not None and frames / header.rate > max_seconds:
        raise InvalidArgument(field_name, f"audio is longer than {max_seconds} s")
    return resample(np.concatenate(blocks), header.rate, AUDIO_SAMPLE_RATE)


_AUDIO_BLOCK_FRAMES = 1 << 16


def decode_image(data: bytes, field_name: str, max_pixels: int | None = None):
    """png/jpeg bytes -> RGB PIL image; InvalidArgument naming the field otherwise. The size the
    header declares is checked before a pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    check_image_size(*declared_image_size(data, field_name), field_name, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in ("PNG", "JPEG"):
                raise InvalidArgument(field_name, f"image format {image.format} is not png or jpeg")
            check_image_size(image.width, image.height, field_name, max_pixels)  # what PIL will decode
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError,
            Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidArgument(field_name, "not a readable png/jpeg image") from None


@dataclass
class Media:
    """A prompt's decoded media, in prompt order (a video's audio track among the audio parts)."""

    audios: list = field(default_factory=list)
    audio_fields: list = field(default_factory=list)  # the request field each audio came from
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)
