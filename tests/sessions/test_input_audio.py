"""A session's input buffer (sessions/input_audio.py): what a detected turn keeps of the audio."""

from __future__ import annotations

import numpy as np
import pytest

from sessions.audio import PCM16, InputFormat
from sessions.input_audio import InputAudio, InputPace
from sessions.turn_detection import WINDOW, SilenceStart, SpeechStart, SpeechStop, TurnDetectionSettings


def scripted(probabilities):
    it = iter(probabilities)
    return lambda: (lambda window: next(it))


def test_a_detected_turn_keeps_the_prefix_padding_before_the_speech_and_nothing_earlier():
    # 16 kHz: one sample a detector sample; windows of 512 = 32 ms; padding 64 ms = 2 windows.
    settings = TurnDetectionSettings(prefix_padding_ms=64, silence_duration_ms=128)
    probabilities = [0.0] * 5 + [0.9] * 3 + [0.0] * 4
    audio = InputAudio(scripted(probabilities))
    audio.configure(InputFormat(PCM16, 16000), settings)
    samples = np.arange(len(probabilities) * WINDOW, dtype=np.int16)
    events = audio.append(samples)
    assert [(type(e), at) for e, at in events] == [(SpeechStart, 5 * WINDOW), (SilenceStart, 8 * WINDOW),
                                                   (SpeechStop, 8 * WINDOW)]
    audio.keep_from(events[0][1] - audio.padding)
    kept = audio.take()
    assert kept[0] == 3 * WINDOW and kept[-1] == samples[-1]  # from 64 ms before the start to what came
    assert not audio.held and audio.start == audio.total


def test_outside_speech_only_the_prefix_padding_is_held():
    audio = InputAudio(scripted([0.0] * 10))
    audio.configure(InputFormat(PCM16, 16000), TurnDetectionSettings(prefix_padding_ms=64))
    for _ in range(10):  # window by window, the buffer in chunks
        audio.append(np.zeros(WINDOW, np.int16))
    audio.trim()
    assert audio.held == len(audio.samples) == 2 * WINDOW


def test_input_beyond_the_burst_at_more_than_the_bound_is_refused_and_not_counted():
    pace = InputPace(realtime=2.0, burst_s=1.0)
    assert pace.take(1.0, now=100.0)  # the burst, at once
    assert not pace.take(0.5, now=100.0)  # nothing more at once
    assert pace.take(0.5, now=100.3)  # 0.3 s later: 0.6 s more is allowed
    assert not pace.take(0.2, now=100.3) and pace.received_s == 1.5
    assert InputPace(realtime=0.0, burst_s=0.0).take(1e6, now=0.0)  # 0: no bound


@pytest.mark.parametrize("rate", [24000, 16000, 8000, 44100])
def test_appends_handed_to_the_detector_only_when_they_complete_a_window_give_every_event_at_its_sample(rate):
    """The session hands an append to the detection thread only when `buffer` says it completes a
    window; appends of any size, with commits between them, give the events and positions of
    detecting every append at once."""
    rng = np.random.default_rng(rate)
    probabilities = rng.choice([0.0, 0.2, 0.45, 0.9], size=4000, p=[0.4, 0.1, 0.1, 0.4]).tolist()
    settings = TurnDetectionSettings(silence_duration_ms=96, prefix_padding_ms=64)
    every, deferred = InputAudio(scripted(probabilities), hold_windows=1), InputAudio(scripted(probabilities), 1)
    for audio in (every, deferred):
        audio.configure(InputFormat(PCM16, rate), settings)
    events, handed = 0, 0
    for i in range(1500):
        size = rng.choice([int(rng.integers(1, 3 * rate // 100)), rate // 50, rate * 16 // 1000, rate * 32 // 1000])
        samples = rng.integers(-3000, 3000, size, dtype=np.int16)  # 0-30 ms, or 20, 16 or 32 ms
        every.buffer(samples)
        at_once = every.detect()  # every append detected at once, due or not
        due = deferred.buffer(samples)
        handed += due
        assert (deferred.detect() if due else []) == at_once, i  # the same events, at the same append
        assert deferred.detector.windows == every.detector.windows, i  # every window heard when whole
        events += len(at_once)
        if i % 97 == 0:  # a commit: the buffer taken, the speech forgotten
            assert np.array_equal(every.take(), deferred.take())
        every.trim()
        deferred.trim()
        assert (every.held, every.total, every.speaking) == (deferred.held, deferred.total, deferred.speaking)
    assert events > 50
    assert handed < 1500 * 0.8  # appends of 0-32 ms: many complete no 32 ms window
