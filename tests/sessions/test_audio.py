"""A session's input audio as numpy arrays (sessions/audio.py): formats, the resampler the turn
detector hears through, the wav a committed turn becomes."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest

from omni.v1 import omni_pb2
from services.base.errors import InvalidArgument
from sessions.audio import FLOAT32, PCM16, InputFormat, Resampler, decode, input_format, wav_bytes


def test_float32_input_is_rounded_to_pcm16_once_and_clipped():
    data = struct.pack("<5f", 0.0, 0.5, -0.5, 1.5, -1.0)
    assert list(decode(data, InputFormat(FLOAT32, 24000), "append_audio.data")) == [0, 16384, -16384, 32767, -32768]


def test_a_partial_sample_is_refused_naming_the_field():
    with pytest.raises(InvalidArgument) as refused:
        decode(b"\x00\x01\x02", InputFormat(PCM16, 16000), "append_audio.data")
    assert refused.value.field == "append_audio.data"


@pytest.mark.parametrize(("encoding", "rate", "field"), [(PCM16, 4000, "sample_rate"), (PCM16, 96000, "sample_rate"),
                                                         (0, 16000, "encoding")])
def test_a_format_outside_what_sessions_take_is_refused_naming_its_field(encoding, rate, field):
    with pytest.raises(InvalidArgument) as refused:
        input_format(omni_pb2.AudioFormat(encoding=encoding, sample_rate=rate), "update.input_format")
    assert refused.value.field == f"update.input_format.{field}"


@pytest.mark.parametrize("rate", [24000, 44100, 8000])
def test_the_resampler_gives_the_same_samples_however_the_stream_is_cut(rate):
    samples = ((np.arange(rate) * 37) % 2000 - 1000).astype(np.int16)
    whole = Resampler(rate).feed(samples)
    resampler, cut = Resampler(rate), []
    i = 0
    for size in [1, 479, 3, 480, 7000, 0] * 10:
        chunk = samples[i:i + size]
        told = resampler.available(len(chunk))  # what the session asks before handing an append over
        cut.append(resampler.feed(chunk))
        assert len(cut[-1]) == told
        i += size
    cut.append(resampler.feed(samples[i:]))
    assert whole.dtype == np.int16 and np.array_equal(whole, np.concatenate(cut))
    assert 0 <= 16000 - len(whole) <= 2  # the last positions wait for the sample after them


def test_the_resampler_interpolates_between_the_two_samples_around_each_position():
    # 24 kHz -> 16 kHz: output k sits at input 1.5 k, halfway between two samples every other time.
    out = Resampler(24000).feed(np.array([0, 100, 200, 300, -300, -301, 7], np.int16))
    assert out.tolist() == [0, 150, 300, -300]  # -300.5 truncated toward zero


def test_a_committed_turn_is_a_wav_at_the_input_rate():
    samples = np.arange(-500, 500, dtype=np.int16)
    with wave.open(io.BytesIO(wav_bytes(samples, 24000))) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert np.array_equal(np.frombuffer(w.readframes(w.getnframes()), "<i2"), samples)
