"""A realtime session's input audio as numpy arrays, never Python lists: the client's samples
(pcm16 or float32 at its stated rate) as int16 [n], resampled to 16 kHz for the turn detector by
vectorized linear interpolation, and a committed turn as the wav file the thinker reads (at the
input's own rate: the thinker resamples, services/runtime/inputs/media.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni.v1 import omni_pb2
from services.base.errors import InvalidArgument
from services.base.wav import wav_file

VAD_RATE = 16000  # what Silero VAD hears
MIN_RATE, MAX_RATE = 8000, 48000
PCM16, FLOAT32 = omni_pb2.AUDIO_ENCODING_PCM16, omni_pb2.AUDIO_ENCODING_FLOAT32
_BYTES = {PCM16: 2, FLOAT32: 4}  # encoding -> bytes a sample


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


def decode(data: bytes, fmt: InputFormat, field: str) -> np.ndarray:
    """The samples of an append as int16 [n]; float32 is clipped to [-1, 1] and rounded once, as
    the gateway rounds its pcm16 output."""
    if len(data) % fmt.sample_bytes:
        raise InvalidArgument(field, f"{len(data)} bytes is not a whole number of "
                                     f"{'pcm16' if fmt.encoding == PCM16 else 'float32'} samples")
    if fmt.encoding == PCM16:
        return np.frombuffer(data, "<i2").astype(np.int16)
    samples = np.frombuffer(data, "<f4")
    nan = np.flatnonzero(np.isnan(samples))
    if nan.size:
        raise InvalidArgument(field, f"float32 sample {nan[0]} is NaN")
    return np.clip(np.rint(samples.astype(np.float64) * 32768.0), -32768, 32767).astype(np.int16)


class Resampler:
    """Streaming linear interpolation from `rate` to `target`, chunk by chunk, exactly as over the
    whole stream: enough for a voice-activity detector (which hears 16 kHz), not for listening.

    Output sample k sits at input position k * rate / target, kept as integers (k * rate and its
    quotient and remainder by target), so where the stream is cut changes no sample."""

    def __init__(self, rate: int, target: int = VAD_RATE):
        self.rate, self.target = rate, target
        self.identity = rate == target
        self.next = 0  # the next output sample's index k
        self.base = 0  # the input index of `held[0]`
        self.held = np.zeros(0, np.int16)  # the last input sample (the one before the next chunk)

    def available(self, n: int) -> int:
        """How many samples `feed` gives for `n` more input samples (the same arithmetic, nothing fed)."""
        if self.identity:
            return n
        size = self.held.size + n
        if not size:
            return 0
        end = ((self.base + size - 1) * self.target + self.rate - 1) // self.rate
        return max(end - self.next, 0)

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """int16 [n] at `rate` -> int16 [m] at `target` (each output sample whose two neighbours have come)."""
        if self.identity:
            return samples
        src = np.concatenate((self.held, samples)).astype(np.int64)
        if not src.size:
            return np.zeros(0, np.int16)
        last = self.base + src.size - 1  # the input index of src[-1]
        # k with k * rate < last * target: both neighbours of its position are here.
        end = (last * self.target + self.rate - 1) // self.rate
        k = np.arange(self.next, max(end, self.next), dtype=np.int64)
        whole, part = np.divmod(k * self.rate, self.target)
        i = whole - self.base
        out = np.trunc(src[i] + (src[i + 1] - src[i]) * part / self.target)  # toward zero, as int() did
        self.next = max(end, self.next)
        self.held, self.base = src[-1:].astype(np.int16), last
        return out.astype(np.int16)


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """A mono 16-bit wav file of int16 `samples` at `rate`."""
    return wav_file(np.asarray(samples, "<i2").tobytes(), rate)
