"""What a stage passes up across a move to another replica (services/serving/migration.py): the
replay's repetition is dropped, checked against a running hash, and never spliced when it differs."""

from __future__ import annotations

import numpy as np
import pytest

from omni.v1 import common_pb2, stages_pb2
from services.serving.migration import Passed, Resume, as_replay
from services.serving.status import ReplayDiverged


def chunk(samples: np.ndarray, index: int) -> common_pb2.AudioChunk:
    return common_pb2.AudioChunk(pcm=samples.astype("<f4").tobytes(), sample_rate=24000, index=index,
                                 num_samples=len(samples), first_frame=0)


def audio_of(chunks) -> np.ndarray:
    return np.concatenate([np.frombuffer(c.pcm, dtype="<f4") for c in chunks])


AUDIO = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
CUTS = [0, 100, 350, 600, 1000]  # the same chunking the original and the replay use


def stream(audio=AUDIO, cuts=CUTS):
    return [chunk(audio[a:b], i) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]


def test_without_a_move_everything_passes_unchanged():
    resume = Resume("talker")
    out = [resume.audio_chunk(c) for c in stream()]
    assert [c.index for c in out] == [0, 1, 2, 3]
    np.testing.assert_array_equal(audio_of(out), AUDIO)
    resume.finish()


def test_after_a_move_the_replay_s_repetition_is_dropped_and_the_rest_goes_on_numbered():
    resume = Resume("talker")
    first = [resume.audio_chunk(c) for c in stream()[:2]]  # 350 samples delivered, then the replica dies
    resume.begin_replay()
    rest = [out for c in stream() if (out := resume.audio_chunk(c)) is not None]
    assert [c.index for c in first + rest] == [0, 1, 2, 3]
    np.testing.assert_array_equal(audio_of(first + rest), AUDIO)
    resume.finish()


def test_a_replay_cut_differently_is_trimmed_to_the_samples_not_delivered():
    resume = Resume("code2wav")
    first = [resume.audio_chunk(c) for c in stream()[:2]]
    resume.begin_replay()
    rest = [out for c in stream(cuts=[0, 200, 500, 1000]) if (out := resume.audio_chunk(c)) is not None]
    np.testing.assert_array_equal(audio_of(first + rest), AUDIO)
    assert rest[0].num_samples == 150  # 350..500: the part of the replay's second chunk not delivered


def test_a_replay_that_parts_from_what_was_delivered_ends_the_request():
    resume = Resume("talker")
    for c in stream()[:2]:
        resume.audio_chunk(c)
    resume.begin_replay()
    other = AUDIO.copy()
    other[10] += 1e-6  # one sample differs by a rounding error: splicing would still be wrong
    with pytest.raises(ReplayDiverged, match="stage talker: the replay .* parted from the audio"):
        for c in stream(other):
            resume.audio_chunk(c)


def test_a_replay_that_ends_before_what_was_delivered_ends_the_request():
    resume = Resume("talker")
    for c in stream():
        resume.audio_chunk(c)
    resume.begin_replay()
    resume.audio_chunk(stream()[0])
    with pytest.raises(ReplayDiverged):
        resume.finish()


def test_codec_frames_and_text_tokens_resume_by_count():
    resume = Resume("talker")
    frames = [common_pb2.CodecFrames(first_frame=f, num_code_groups=2, ids=[f, -f]) for f in range(5)]
    delivered = [resume.codec_frames(f) for f in frames[:3]]
    resume.begin_replay()
    after = [out for f in frames if (out := resume.codec_frames(f)) is not None]
    assert [f.first_frame for f in delivered + after] == [0, 1, 2, 3, 4]
    text = Passed("thinker", "text")
    assert [text.admit(bytes([t]), 1) for t in (5, 6)] == [0, 0]
    text.begin_replay()
    assert [text.admit(bytes([t]), 1) for t in (5, 6, 7)] == [1, 1, 0]
    assert text.count == 3


def test_a_start_is_copied_marked_a_replay_and_the_original_is_left_alone():
    start = stages_pb2.TalkerStart(request_id="r")
    replay = as_replay(start)
    assert replay.replay and replay.request_id == "r"
    assert not start.replay
    assert as_replay(stages_pb2.ThinkerRequest()).replay
