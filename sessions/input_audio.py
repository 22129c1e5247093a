"""A realtime session's input audio: the buffer of 16-bit samples at the input rate, and the turn
detector over it. Positions are absolute input samples since the session's start; what to do with
a speech start or stop is the session's (sessions/session.py)."""

from __future__ import annotations

from array import array
from collections.abc import Callable

from sessions.audio import InputFormat, Resampler
from sessions.turn_detection import SpeechStart, SpeechStop, TurnDetectionSettings, TurnDetector


class InputAudio:
    def __init__(self, vad_factory: Callable[[], Callable[[array], float]]):
        self.vad_factory = vad_factory  # () -> a fresh detector: 512 16 kHz samples -> speech probability
        self.samples = array("h")  # the buffer
        self.start = 0  # absolute sample of samples[0]
        self.total = 0  # samples received
        self.rate = 0
        self.padding = 0  # samples kept before a detected start (prefix_padding_ms)
        self.resampler: Resampler | None = None
        self.detector: TurnDetector | None = None  # None: turn detection off
        self.origin = 0  # absolute sample the detector's clock starts at

    def configure(self, fmt: InputFormat, detection: TurnDetectionSettings) -> None:
        """A new format or turn detection: a fresh detector, its clock from the next sample on."""
        self.rate = fmt.sample_rate
        self.padding = detection.prefix_padding_ms * self.rate // 1000
        self.resampler = Resampler(self.rate)
        self.detector = TurnDetector(detection, self.vad_factory()) if detection.enabled else None
        self.origin = self.total

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.rate

    def ms(self, sample: int) -> int:
        """An absolute sample as milliseconds of the session's input."""
        return sample * 1000 // self.rate

    def append(self, samples: array) -> list[tuple[SpeechStart | SpeechStop, int]]:
        """Buffer `samples`; the detector's speech starts and stops in them, each with its absolute sample."""
        self.samples.extend(samples)
        self.total += len(samples)
        if self.detector is None:
            return []
        events = self.detector.feed(self.resampler.feed(samples))
        return [(event, self.origin + event.at_ms * self.rate // 1000) for event in events]

    @property
    def speaking(self) -> bool:
        return self.detector is not None and self.detector.speaking

    def keep_from(self, sample: int) -> None:
        """Drop what came before `sample` (never what a commit already took)."""
        sample = max(sample, self.start)
        del self.samples[:sample - self.start]
        self.start = sample

    def trim(self) -> None:
        """Outside speech (with turn detection), keep only the prefix padding."""
        if self.detector is not None and not self.detector.speaking:
            self.keep_from(self.total - self.padding)

    def take(self) -> array:
        """The buffer's samples, and an empty buffer from the next sample on."""
        samples, self.samples = self.samples, array("h")
        self.start = self.total
        if self.detector is not None:
            self.detector.reset()
        return samples

    def clear(self) -> None:
        self.take()
