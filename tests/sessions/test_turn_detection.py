"""Turn detection (sessions/turn_detection.py): the rule on made-up probabilities, and Silero VAD on
the committed espeak-ng recordings (bench/speech/) with silences between them."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest

from omni.v1 import omni_pb2
from services.base.errors import InvalidArgument
from sessions.turn_detection import (
    SILENT_PEAK,
    WINDOW,
    WINDOW_MS,
    SilenceStart,
    Silero,
    SpeechResumed,
    SpeechStart,
    SpeechStop,
    TurnDetectionSettings,
    TurnDetector,
    onnx_model,
    silero,
)

SPEECH = sorted((Path(__file__).parents[2] / "bench" / "speech").glob("*.wav"))


def scripted(probabilities: list[float]):
    """A detector that answers each window with the next of `probabilities`."""
    it = iter(probabilities)
    return lambda window: next(it)


def windows(n: int) -> np.ndarray:
    return np.zeros(WINDOW * n, np.int16)


def test_speech_stops_after_the_silence_setting_and_is_reported_where_the_silence_began():
    settings = TurnDetectionSettings(silence_duration_ms=160)  # 5 windows of 32 ms
    probabilities = [0.1, 0.9, 0.9, 0.9] + [0.1] * 5 + [0.1]
    detector = TurnDetector(settings, scripted(probabilities))
    events = detector.feed(windows(len(probabilities)))
    assert events == [SpeechStart(1 * WINDOW_MS), SilenceStart(4 * WINDOW_MS, 5 * WINDOW_MS), SpeechStop(4 * WINDOW_MS)]


def test_a_dip_shorter_than_the_silence_setting_does_not_end_speech():
    settings = TurnDetectionSettings(silence_duration_ms=160)
    probabilities = [0.9, 0.1, 0.1, 0.1, 0.9, 0.4, 0.2, 0.9]
    detector = TurnDetector(settings, scripted(probabilities))
    # Each silence that began is said, and the speech that came back (a held answer is dropped there);
    # 0.4 is neither speech nor silence (between threshold - 0.15 and the threshold): nothing.
    assert detector.feed(windows(len(probabilities))) == [
        SpeechStart(0), SilenceStart(1 * WINDOW_MS, 2 * WINDOW_MS), SpeechResumed(4 * WINDOW_MS),
        SilenceStart(6 * WINDOW_MS, 7 * WINDOW_MS), SpeechResumed(7 * WINDOW_MS)]
    assert detector.speaking


def test_samples_short_of_a_window_wait_for_the_next_feed():
    detector = TurnDetector(TurnDetectionSettings(), scripted([0.9]))
    assert detector.feed(np.zeros(WINDOW - 1, np.int16)) == []
    assert detector.feed(np.zeros(1, np.int16)) == [SpeechStart(0)]


@pytest.mark.parametrize(("field", "value"), [("threshold", 1.0), ("threshold", 0.0), ("silence_duration_ms", 50),
                                              ("silence_duration_ms", 6000), ("prefix_padding_ms", 2500)])
def test_out_of_range_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidArgument) as refused:
        TurnDetectionSettings().updated(omni_pb2.TurnDetection(**{field: value}), "update.turn_detection")
    assert refused.value.field == f"update.turn_detection.{field}"


def test_silero_hears_each_recording_between_silences_as_one_turn():
    assert len(SPEECH) >= 3
    silence = np.zeros(16000, np.int16)  # 1 s
    parts, spans, at = [], [], 0
    for path in SPEECH:
        with wave.open(str(path)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
            speech = np.frombuffer(w.readframes(w.getnframes()), "<i2")
        spans.append(((at + len(silence)) * 1000 // 16000, (at + len(silence) + len(speech)) * 1000 // 16000))
        parts += [silence, speech]
        at += len(silence) + len(speech)
    audio = np.concatenate(parts + [silence])
    detector = TurnDetector(TurnDetectionSettings(), silero())
    events = []
    for i in range(0, len(audio), 320):  # 20 ms appends, as a microphone sends them
        events += detector.feed(audio[i:i + 320])
    events = [e for e in events if isinstance(e, SpeechStart | SpeechStop)]
    assert [type(e) for e in events] == [SpeechStart, SpeechStop] * len(SPEECH), events
    for (start, stop), (began, ended) in zip(zip(events[::2], events[1::2]), spans):
        assert began - 100 <= start.at_ms <= began + 300, (start, began)
        assert ended - 300 <= stop.at_ms <= ended + 300, (stop, ended)


def test_a_window_of_digital_silence_is_silence_without_the_model_which_starts_over_at_the_next_sound():
    vad, asked = Silero(), []

    class Counting:  # the process's one model, each call seen
        def run(self, outputs, feeds):
            asked.append(feeds["input"])
            return onnx_model().run(outputs, feeds)

    vad.model = Counting()
    assert vad(np.full(WINDOW, SILENT_PEAK - 1, np.int16)) == 0.0 and not asked
    with wave.open(str(SPEECH[0])) as w:
        speech = np.frombuffer(w.readframes(WINDOW * 20), "<i2")[-WINDOW:]
    fresh = Silero()(speech)  # a new detector's first window
    assert vad(speech) == fresh and len(asked) == 1
    assert asked[0].dtype == np.float32 and asked[0].shape == (1, Silero.CONTEXT + WINDOW)


def test_the_model_carries_its_state_and_context_from_window_to_window_as_silero_vads_own_wrapper():
    """Each window after the previous one's last 64 samples, with the state it left: the same
    probabilities as the model given the windows one stream at a time by hand, and not those of
    windows heard each alone (so the state is really carried)."""
    with wave.open(str(SPEECH[0])) as w:
        speech = np.frombuffer(w.readframes(WINDOW * 12), "<i2")
    windows = speech.reshape(-1, WINDOW)
    vad = Silero()
    heard = [vad(window) for window in windows]
    state, context, by_hand = np.zeros((2, 1, 128), np.float32), np.zeros(64, np.float32), []
    for window in windows:
        scaled = window.astype(np.float32) / np.float32(32767)
        out, state = onnx_model().run(None, {"input": np.concatenate((context, scaled))[None], "state": state,
                                             "sr": np.array(16000, np.int64)})
        context = scaled[-64:]
        by_hand.append(float(out[0, 0]))
    assert heard == by_hand
    assert heard != [Silero()(window) for window in windows]


def test_a_silence_start_comes_after_the_hold_windows_and_a_resume_only_after_one():
    settings = TurnDetectionSettings(silence_duration_ms=160)  # 5 windows
    probabilities = [0.9, 0.1, 0.1, 0.9, 0.1, 0.1, 0.1, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1]
    detector = TurnDetector(settings, scripted(probabilities), hold_windows=3)
    assert detector.feed(windows(len(probabilities))) == [
        SpeechStart(0),  # the two-window dip: no SilenceStart, so no resume either
        SilenceStart(4 * WINDOW_MS, 7 * WINDOW_MS), SpeechResumed(7 * WINDOW_MS),
        SilenceStart(8 * WINDOW_MS, 11 * WINDOW_MS), SpeechStop(8 * WINDOW_MS)]
    # A hold as long as the silence setting says nothing before the stop.
    detector = TurnDetector(settings, scripted([0.9] + [0.1] * 5), hold_windows=5)
    assert detector.feed(windows(6)) == [SpeechStart(0), SpeechStop(1 * WINDOW_MS)]
