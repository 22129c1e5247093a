"""How codec frames are cut into chunks on their way from the talker to code2wav. The cuts decide
when audio can be made, never its bits: code2wav decodes on a fixed grid of blocks whatever the
cuts (services/code2wav/blocks.py).

NOTE: growth. With 4 then 25 frames, the 25-frame chunk takes longer to make than the 0.32 s the
first one plays, so playback runs dry once per request (omni-bench's underrun figure). Doubling
(4, 8, 16, 25, 25, ...) keeps each chunk's production shorter than the audio already queued, at a
few more code2wav calls per request.

NOTE: running dry. Those sizes assume the talker runs well ahead of real time: the chunk ending
at frame C(k) is made while the C(k-1) frames before it play, which asks for 2.2x real time for
the second chunk (docs/performance.md, "Underruns at 16"). When many requests start together the
talker's first steps for each are slower than that, and a listener ran dry waiting for a chunk
that was half made. So a chunk also goes out before it is full when waiting for one more frame
would make it late: when the next frame, as far behind this one as this one was behind the
last, would come less than `delivery_ms` (code2wav's decode and the hops up to the listener)
before the audio already sent runs out. That audio is counted from when the first chunk's audio
came back from code2wav on its way up (`playing`: the listener starts a few ms later, never
earlier), at the family's seconds per frame. The listener gets the frames that exist instead of
silence, at the price of a smaller code2wav call; a talker that keeps ahead never cuts early, and
the schedule's cuts stay where they were, so one that catches up is back on 4, 8, 16, 25.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkPolicy:
    first: int = 4  # frames in the first chunk (time to first audio)
    rest: int = 25  # frames in every later chunk, once grown
    growth: int = 2  # each chunk this many times the last until `rest` (1 = straight to `rest`)
    delivery_ms: float = 100.0  # a chunk's way to the listener: cut early to keep to it (the note; 0 = never)

    def __post_init__(self):
        if self.first < 1 or self.rest < 1 or self.growth < 1:
            raise ValueError(f"chunk sizes and growth must be at least 1, got {self.first}, {self.rest}, {self.growth}")
        if self.delivery_ms < 0:
            raise ValueError(f"delivery_ms must be >= 0, got {self.delivery_ms}")

    def next_size(self, size: int) -> int:
        return self.rest if self.growth <= 1 else min(size * self.growth, self.rest)

    def schedule(self) -> tuple[int, ...]:
        """The chunk sizes until the steady one, which repeats: (4, 8, 16, 25) by default. Code2wav
        decodes on a grid of blocks of these sizes (services/code2wav/blocks.py), so a talker that
        keeps to the schedule sends it whole blocks."""
        sizes, size = [self.first], self.next_size(self.first)
        while size != sizes[-1]:
            sizes.append(size)
            size = self.next_size(size)
        return tuple(sizes)

    def sizes(self, frames: int) -> list[int]:
        """Chunk sizes for a stream of `frames` frames (the last one is whatever is left)."""
        sizes, size = [], self.first
        while frames > 0:
            sizes.append(min(size, frames))
            frames -= sizes[-1]
            size = self.next_size(size)
        return sizes


DEFAULT_CHUNKS = ChunkPolicy()


class FrameChunker:
    """Groups one stream's frames into chunks as `policy` says. Given the seconds of audio a frame
    decodes to and a clock (`add`'s `now`), it also cuts a chunk early when the audio already sent
    is about to run out (the module note)."""

    def __init__(self, policy: ChunkPolicy = DEFAULT_CHUNKS, seconds_per_frame: float | None = None):
        self.policy = policy
        self.seconds_per_frame = seconds_per_frame  # None: cut by the schedule alone
        self.size = policy.first  # size of the schedule's chunk being filled
        self.cut_at = policy.first  # frames sent once that chunk is out
        self.frames: list[torch.Tensor] = []  # pending [num_code_groups] rows
        self.sent = 0  # frames already handed out
        self.playing_since: float | None = None  # clock time the first audio went up: the listener starts after it
        self.last_frame_at: float | None = None  # clock time of the last frame added

    def add(self, codes: torch.Tensor, now: float | None = None) -> torch.Tensor | None:
        self.frames.append(codes)
        gap = now - self.last_frame_at if now is not None and self.last_frame_at is not None else 0.0
        self.last_frame_at = now
        if self.sent + len(self.frames) >= self.cut_at or self.running_dry(now, gap):
            return self.flush()
        return None

    def playing(self, now: float) -> None:
        """The stream's first audio went up to the listener at `now` (later calls change nothing)."""
        if self.playing_since is None:
            self.playing_since = now

    def running_dry(self, now: float | None, gap: float) -> bool:
        """Whether a frame `gap` seconds after `now` would reach the listener too late to go with this
        chunk: after the audio sent so far runs out, less the policy's `delivery_ms`."""
        if now is None or self.seconds_per_frame is None or self.playing_since is None or self.policy.delivery_ms <= 0:
            return False
        runs_out = self.playing_since + self.sent * self.seconds_per_frame
        return now + gap >= runs_out - self.policy.delivery_ms / 1000

    def flush(self) -> torch.Tensor | None:
        if not self.frames:
            return None
        chunk = torch.stack(self.frames)  # [n, num_code_groups]
        self.sent += len(self.frames)
        self.frames = []
        while self.cut_at <= self.sent:  # the schedule's next cut (an early chunk leaves it in place)
            self.size = self.policy.next_size(self.size)
            self.cut_at += self.size
        return chunk
