"""A session's input audio in pure Python (sessions/audio.py): formats, the resampler the
turn detector hears through, the wav a committed turn becomes."""

from __future__ import annotations

import io
import struct
import wave
from array import array

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


def test_the_resampler_gives_the_same_samples_however_the_stream_is_cut():
    samples = array("h", [(i * 37) % 2000 - 1000 for i in range(24000)])
    whole = Resampler(24000).feed(samples)
    resampler, cut = Resampler(24000), array("h")
    i = 0
    for size in [1, 479, 3, 480, 7000] * 10:
        cut.extend(resampler.feed(samples[i:i + size]))
        i += size
    cut.extend(resampler.feed(samples[i:]))
    assert len(whole) == len(cut) and whole == cut
    assert abs(len(whole) - 16000) <= 1


def test_a_committed_turn_is_a_wav_at_the_input_rate():
    samples = array("h", range(-500, 500))
    with wave.open(io.BytesIO(wav_bytes(samples, 24000))) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert array("h", w.readframes(w.getnframes())) == samples
