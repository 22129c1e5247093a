"""The figures users compare, computed from client-side timelines (docs/architecture.md, Measures).

Pure functions on plain numbers: no torch, gRPC or clocks, so every definition is unit-tested on
made-up timelines.

- TTFT: request sent -> first text delta. TTFP: request sent -> first audio chunk.
- RTF: (last audio chunk - request sent) / seconds of audio returned.
- Streaming RTF: the same from the first audio chunk on: (last chunk - first chunk) / the seconds
  of audio after the first chunk. Below 1, a player that started at the first chunk never runs
  dry; it leaves the wait for the first chunk (TTFP) out, so it is the steady state's figure.
- Throughput: completed requests per wall second of a block at fixed concurrency, and seconds
  of audio per wall second.
- Percentiles: linear interpolation between closest ranks (numpy's default), p50 / p90 / p99.
- Continuity: a simulated player starts when the first chunk arrives (plus an optional
  pre-buffer) and plays chunks back to back; a chunk that arrives after the audio before it has
  run out is an underrun, as long as the gap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestTiming:
    """One request's timeline, in seconds from the moment it was sent."""

    text_times: tuple[float, ...]  # arrival of each text delta
    audio_times: tuple[float, ...]  # arrival of each audio chunk
    audio_durations: tuple[float, ...]  # seconds of audio in each chunk, same order
    done: float  # the end of the response stream

    def __post_init__(self):
        if len(self.audio_times) != len(self.audio_durations):
            raise ValueError("audio_times and audio_durations differ in length")
        if any(b < a for a, b in zip(self.audio_times, self.audio_times[1:])):
            raise ValueError("audio chunks must be in arrival order")

    @property
    def ttft_s(self) -> float | None:
        return self.text_times[0] if self.text_times else None

    @property
    def ttfp_s(self) -> float | None:
        return self.audio_times[0] if self.audio_times else None

    @property
    def audio_seconds(self) -> float:
        return float(sum(self.audio_durations))

    @property
    def rtf(self) -> float | None:
        seconds = self.audio_seconds
        return self.audio_times[-1] / seconds if seconds > 0 else None

    @property
    def streaming_rtf(self) -> float | None:
        """None with fewer than two chunks (nothing streamed after the first)."""
        after_first = self.audio_seconds - (self.audio_durations[0] if self.audio_durations else 0.0)
        if len(self.audio_times) < 2 or after_first <= 0:
            return None
        return (self.audio_times[-1] - self.audio_times[0]) / after_first


def whole_response(wall_s: float, audio_seconds: float, wait_s: float = 0.0) -> RequestTiming:
    """A system that streams nothing (transformers' generate): text and all audio arrive at the end.

    `wait_s`: time the request queued before its generate started; it is part of every latency.
    """
    end = wait_s + wall_s
    return RequestTiming(text_times=(end,), audio_times=(end,) if audio_seconds > 0 else (),
                         audio_durations=(audio_seconds,) if audio_seconds > 0 else (), done=end)


@dataclass(frozen=True)
class Percentiles:
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None
    n: int


def percentile(values: list[float], q: float) -> float | None:
    """q in [0, 100]; None for no values; linear interpolation between closest ranks."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def percentiles(values: list[float | None]) -> Percentiles:
    present = [float(v) for v in values if v is not None]
    mean = float(np.mean(present)) if present else None
    return Percentiles(percentile(present, 50), percentile(present, 90), percentile(present, 99), mean, len(present))


@dataclass(frozen=True)
class Playback:
    underruns: int  # times the player ran dry before the stream ended
    underrun_s: float  # total silence inserted by those
    start_s: float | None  # when playback began (first chunk + pre-buffer); None without audio


def simulate_playback(audio_times: tuple[float, ...], durations: tuple[float, ...],
                      prebuffer_s: float = 0.0) -> Playback:
    """Play chunks back to back from the first arrival (+ prebuffer); count the gaps."""
    if not audio_times:
        return Playback(0, 0.0, None)
    start = audio_times[0] + prebuffer_s
    played_until = start  # when the audio received so far runs out
    count, silence = 0, 0.0
    for arrival, duration in zip(audio_times, durations):
        if arrival > played_until:
            count += 1
            silence += arrival - played_until
            played_until = arrival
        played_until += duration
    return Playback(count, silence, start)


@dataclass(frozen=True)
class Continuity:
    underruns_per_request: Percentiles  # count per request
    underrun_s_per_request: Percentiles  # seconds of silence per request
    requests_with_underrun: int
    prebuffer_s: float


def continuity(timings: list[RequestTiming], prebuffer_s: float = 0.0) -> Continuity:
    plays = [simulate_playback(t.audio_times, t.audio_durations, prebuffer_s) for t in timings if t.audio_times]
    return Continuity(
        underruns_per_request=percentiles([p.underruns for p in plays]),
        underrun_s_per_request=percentiles([p.underrun_s for p in plays]),
        requests_with_underrun=sum(1 for p in plays if p.underruns > 0),
        prebuffer_s=prebuffer_s,
    )


@dataclass(frozen=True)
class BlockSummary:
    """Every figure of one system at one concurrency (all rounds together)."""

    requests: int  # completed
    errors: int
    wall_s: float  # summed over the blocks (rounds) that ran
    req_per_s: float | None
    audio_s_per_s: float | None
    audio_seconds: Percentiles  # per request
    ttft_ms: Percentiles
    ttfp_ms: Percentiles
    rtf: Percentiles
    continuity: Continuity


def summarize(timings: list[RequestTiming], errors: int, wall_s: float, prebuffer_s: float = 0.0) -> BlockSummary:
    """`wall_s`: first send to last completion of each block, summed over blocks."""
    audio_total = sum(t.audio_seconds for t in timings)
    return BlockSummary(
        requests=len(timings),
        errors=errors,
        wall_s=wall_s,
        req_per_s=len(timings) / wall_s if wall_s > 0 else None,
        audio_s_per_s=audio_total / wall_s if wall_s > 0 else None,
        audio_seconds=percentiles([t.audio_seconds for t in timings]),
        ttft_ms=percentiles([None if t.ttft_s is None else t.ttft_s * 1000 for t in timings]),
        ttfp_ms=percentiles([None if t.ttfp_s is None else t.ttfp_s * 1000 for t in timings]),
        rtf=percentiles([t.rtf for t in timings]),
        continuity=continuity(timings, prebuffer_s),
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
