"""How codec frames are cut into chunks on their way from the talker to code2wav: one policy that
the talker's chunker and code2wav's CUDA-graph windows both derive from.

NOTE: growth. With 4 then 25 frames, the 25-frame chunk takes longer to make than the 0.32 s the
first one plays, so playback runs dry once per request (omni-bench's underrun figure). Doubling
(4, 8, 16, 25, 25, ...) keeps each chunk's production shorter than the audio already queued, at a
few more code2wav calls per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkPolicy:
    first: int = 4  # frames in the first chunk (time to first audio)
    rest: int = 25  # frames in every later chunk, once grown
    growth: int = 2  # each chunk this many times the last until `rest` (1 = straight to `rest`)

    def next_size(self, size: int) -> int:
        return self.rest if self.growth <= 1 else min(size * self.growth, self.rest)

    def sizes(self, frames: int) -> list[int]:
        """Chunk sizes for a stream of `frames` frames (the last one is whatever is left)."""
        sizes, size = [], self.first
        while frames > 0:
            sizes.append(min(size, frames))
            frames -= sizes[-1]
            size = self.next_size(size)
        return sizes

    def windows(self, left_context: int, frames: int | None = None) -> tuple[int, ...]:
        """Window lengths (left context + chunk) a re-decoding vocoder sees: for a stream of
        exactly `frames` frames (its tail included), or, with None, for every full chunk until the
        steady size: the shapes worth capturing as CUDA graphs at start-up."""
        if frames is None:
            sizes, size = [], self.first
            while size not in sizes:
                sizes.append(size)
                size = self.next_size(size)
            sizes.append(size)  # the steady size, now with a full left context
        else:
            sizes = self.sizes(frames)
        windows, seen = set(), 0
        for size in sizes:
            windows.add(min(left_context, seen) + size)
            seen += size
        return tuple(sorted(windows))


DEFAULT_CHUNKS = ChunkPolicy()


class FrameChunker:
    """Groups one stream's frames into chunks as `policy` says."""

    def __init__(self, policy: ChunkPolicy = DEFAULT_CHUNKS):
        self.policy = policy
        self.size = policy.first  # size of the chunk being filled
        self.frames: list[torch.Tensor] = []  # pending [num_code_groups] rows
        self.sent = 0  # frames already handed out

    def add(self, codes: torch.Tensor) -> torch.Tensor | None:
        self.frames.append(codes)
        return self.flush() if len(self.frames) >= self.size else None

    def flush(self) -> torch.Tensor | None:
        if not self.frames:
            return None
        chunk = torch.stack(self.frames)  # [n, num_code_groups]
        self.sent += len(self.frames)
        self.frames = []
        self.size = self.policy.next_size(self.size)
        return chunk
