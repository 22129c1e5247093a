"""A realtime session's input audio: the buffer of int16 samples at the input rate, the turn
detector over it, and the bound on how fast a client may send it. Positions are absolute input
samples since the session's start; what to do with a speech start or stop is the session's
(sessions/session.py).

`InputAudio.detect` is the one call that runs the detector (about 0.13 ms of CPU per 32 ms window):
the session calls it on its replica's detection thread, never on the event loop, and only for an
append that completes a window (`buffer` says which). Samples that complete none wait for the next
that does: the detector changes state only at a whole window (a clear or commit in between resets
its speech, not its samples short of a window), so feeding them later gives the same events at the
same positions, and a session of 20 ms appends hands over 31 appends a second, not 50."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from sessions.audio import InputFormat, Resampler
from sessions.turn_detection import Event, TurnDetectionSettings, TurnDetector


class InputAudio:
    def __init__(self, vad_factory: Callable[[], Callable[[np.ndarray], float]], hold_windows: int = 1):
        self.vad_factory = vad_factory  # () -> a fresh detector: int16 [512] at 16 kHz -> speech probability
        self.hold_windows = hold_windows  # silent windows before a SilenceStart (TurnDetector)
        # The buffer: int16 arrays in order, joined once when taken (an append never copies what is held).
        self.chunks: list[np.ndarray] = []
        self.held = 0  # samples in the buffer
        self.start = 0  # absolute sample of the buffer's first
        self.total = 0  # samples received
        self.rate = 0
        self.padding = 0  # samples kept before a detected start (prefix_padding_ms)
        self.resampler: Resampler | None = None
        self.detector: TurnDetector | None = None  # None: turn detection off
        self.origin = 0  # absolute sample the detector's clock starts at
        self.unheard: list[np.ndarray] = []  # appended, not yet fed to the detector (short of a window)
        self.unheard_count = 0

    def configure(self, fmt: InputFormat, detection: TurnDetectionSettings) -> None:
        """A new format or turn detection: a fresh detector, its clock from the next sample on."""
        self.rate = fmt.sample_rate
        self.padding = detection.prefix_padding_ms * self.rate // 1000
        self.resampler = Resampler(self.rate)
        self.detector = TurnDetector(detection, self.vad_factory(), self.hold_windows) if detection.enabled else None
        self.origin = self.total
        self.unheard, self.unheard_count = [], 0

    @property
    def samples(self) -> np.ndarray:
        """The buffer as one int16 [held] array."""
        if len(self.chunks) != 1:
            self.chunks = [np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)]
        return self.chunks[0]

    @property
    def seconds(self) -> float:
        return self.held / self.rate

    def ms(self, sample: int) -> int:
        """An absolute sample as milliseconds of the session's input."""
        return sample * 1000 // self.rate

    def append(self, samples: np.ndarray) -> list[tuple[Event, int]]:
        """Buffer int16 `samples`; the detector's events in them, each with its absolute sample."""
        return self.detect() if self.buffer(samples) else []

    def buffer(self, samples: np.ndarray) -> bool:
        """Buffer int16 `samples` (cheap: no copy); whether they complete a window of the detector,
        so that `detect` has work."""
        self.chunks.append(samples)
        self.held += len(samples)
        self.total += len(samples)
        if self.detector is None:
            return False
        self.unheard.append(samples)
        self.unheard_count += len(samples)
        return self.detector.due(self.resampler.available(self.unheard_count))

    def detect(self) -> list[tuple[Event, int]]:
        """Feed the detector what it has not heard; its events, each with its absolute sample."""
        if self.detector is None or not self.unheard:
            return []
        unheard = self.unheard[0] if len(self.unheard) == 1 else np.concatenate(self.unheard)
        self.unheard, self.unheard_count = [], 0
        events = self.detector.feed(self.resampler.feed(unheard))
        return [(event, self.sample(event.at_ms)) for event in events]

    @property
    def speaking(self) -> bool:
        return self.detector is not None and self.detector.speaking

    def keep_from(self, sample: int) -> None:
        """Drop what came before `sample` (never what a commit already took)."""
        drop = min(max(sample, self.start) - self.start, self.held)
        self.start += drop
        self.held -= drop
        while drop:
            first = self.chunks[0]
            if len(first) <= drop:
                self.chunks.pop(0)
                drop -= len(first)
            else:
                self.chunks[0] = first[drop:]
                drop = 0

    def trim(self) -> None:
        """Outside speech (with turn detection), keep only the prefix padding."""
        if self.detector is not None and not self.detector.speaking:
            self.keep_from(self.total - self.padding)

    def sample(self, ms: int) -> int:
        """The absolute sample of the detector's `ms` (its clock starts at `origin`)."""
        return self.origin + ms * self.rate // 1000

    def upto(self, sample: int) -> np.ndarray:
        """The buffer's samples before the absolute `sample`, int16; the buffer unchanged."""
        return self.samples[:max(min(sample, self.total) - self.start, 0)]

    def take(self, upto: int | None = None) -> np.ndarray:
        """The buffer's samples (those before the absolute sample `upto`, when given), int16; the
        buffer holds what is left, from the next sample on."""
        samples = self.samples
        taken = samples if upto is None else self.upto(upto)
        rest = samples[len(taken):]
        self.chunks, self.held, self.start = [rest] if len(rest) else [], len(rest), self.start + len(taken)
        if self.detector is not None:
            self.detector.reset()
        return taken

    def clear(self) -> None:
        self.take()


class InputPace:
    """The bound on input speed: a client may send `burst_s` seconds of audio at once and then at
    most `realtime` times real time (0: no bound); an append beyond it is refused, never buffered.
    The clock starts at the first append."""

    def __init__(self, realtime: float, burst_s: float):
        self.realtime, self.burst_s = realtime, burst_s
        self.started: float | None = None  # monotonic time of the first append
        self.received_s = 0.0  # audio taken so far

    def take(self, seconds: float, now: float) -> bool:
        """Whether `seconds` more audio at `now` is within the bound (and then counted)."""
        if self.started is None:
            self.started = now
        if self.realtime and self.received_s + seconds > self.burst_s + self.realtime * (now - self.started):
            return False
        self.received_s += seconds
        return True
