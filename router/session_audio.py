"""A realtime session's input audio, in pure Python (the router imports no numpy): the client's
samples (pcm16 or float32 at its stated rate) as 16-bit samples, resampled to 16 kHz for the
turn detector, and a committed turn as the wav file the thinker reads (at the input's own rate:
the thinker resamples, services/runtime/inputs/media.py)."""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass

from omni.v1 import omni_pb2
from services.base.errors import InvalidArgument
from services.base.wav import wav_file

VAD_RATE = 16000  # what Silero VAD hears
MIN_RATE, MAX_RATE = 8000, 48000
PCM16, FLOAT32 = omni_pb2.AUDIO_ENCODING_PCM16, omni_pb2.AUDIO_ENCODING_FLOAT32
_BYTES = {PCM16: 2, FLOAT32: 4}  # encoding -> bytes a sample
_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True)
class InputFormat:
    encoding: int  # omni_pb2.AudioEncoding
    sample_rate: int

    @property
    def sample_bytes(self) -> int:
        return _BYTES[self.encoding]

    def to_proto(self) -> omni_pb2.AudioFormat:
        return omni_pb2.AudioFormat(encoding=self.encoding, sample_rate=self.sample_rate)


DEFAULT_FORMAT = InputFormat(PCM16, VAD_RATE)


def input_format(proto: omni_pb2.AudioFormat, field: str) -> InputFormat:
    """The session's input format; InvalidArgument naming the field when it is one we do not take."""
    if proto.encoding not in _BYTES:
        raise InvalidArgument(f"{field}.encoding", "must be AUDIO_ENCODING_PCM16 or AUDIO_ENCODING_FLOAT32")
    if not MIN_RATE <= proto.sample_rate <= MAX_RATE:
        raise InvalidArgument(f"{field}.sample_rate",
                              f"must be in [{MIN_RATE}, {MAX_RATE}] Hz, got {proto.sample_rate}")
    return InputFormat(proto.encoding, proto.sample_rate)


def decode(data: bytes, fmt: InputFormat, field: str) -> array:
    """The samples of an append as 16-bit ints (array 'h'); float32 is clipped to [-1, 1] and
    rounded once, as the gateway rounds its pcm16 output."""
    if len(data) % fmt.sample_bytes:
        raise InvalidArgument(field, f"{len(data)} bytes is not a whole number of "
                                     f"{'pcm16' if fmt.encoding == PCM16 else 'float32'} samples")
    samples = array("h" if fmt.encoding == PCM16 else "f")
    samples.frombytes(data)
    if not _LITTLE:
        samples.byteswap()
    if fmt.encoding == PCM16:
        return samples
    out = array("h", bytes(2 * len(samples)))
    for i, x in enumerate(samples):
        if x != x:  # NaN
            raise InvalidArgument(field, f"float32 sample {i} is NaN")
        out[i] = max(-32768, min(32767, round(x * 32768.0)))
    return out


class Resampler:
    """Streaming linear interpolation from `rate` to `target`, chunk by chunk, as if over the whole
    stream: enough for a voice-activity detector (which hears 16 kHz), not for listening."""

    def __init__(self, rate: int, target: int = VAD_RATE):
        self.step = rate / target  # input samples per output sample
        self.identity = rate == target
        self.position = 0.0  # of the next output sample, in input samples from the first kept one
        self.last: int | None = None  # the input sample before the current chunk

    def feed(self, samples: array) -> array:
        if self.identity:
            return samples
        prefix = array("h", [self.last]) if self.last is not None else array("h")
        src = prefix + samples  # src[0] is the sample at self.position's origin
        out = array("h")
        position, step, end = self.position, self.step, len(src) - 1
        while position < end:
            i = int(position)
            frac = position - i
            out.append(int(src[i] + (src[i + 1] - src[i]) * frac))
            position += step
        if src:
            # The next chunk starts one sample after src's last: keep it as the new origin.
            self.position = position - end
            self.last = src[-1]
        return out


def wav_bytes(samples: array, rate: int) -> bytes:
    """A mono 16-bit wav file of `samples` at `rate`."""
    return wav_file((samples if _LITTLE else _swapped(samples)).tobytes(), rate)


def _swapped(samples: array) -> array:
    copy = array("h", samples)
    copy.byteswap()
    return copy
