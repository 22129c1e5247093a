"""The talker's chunking of codec frames for code2wav: a small first chunk, then growing ones."""

from __future__ import annotations

import torch

from services.talker.server import FrameChunker


def chunk_sizes(chunker: FrameChunker, frames: int) -> list[int]:
    sizes = []
    for i in range(frames):
        chunk = chunker.add(torch.full((16,), i))
        if chunk is not None:
            sizes.append(chunk.shape[0])
    tail = chunker.flush()
    return sizes + ([tail.shape[0]] if tail is not None else [])


def test_chunks_double_from_the_first_up_to_the_steady_size_and_the_tail_is_flushed():
    assert chunk_sizes(FrameChunker(4, 25, growth=2), 100) == [4, 8, 16, 25, 25, 22]


def test_growth_one_goes_straight_from_the_first_chunk_to_the_steady_size():
    assert chunk_sizes(FrameChunker(4, 25, growth=1), 60) == [4, 25, 25, 6]


def test_frames_keep_their_order_and_first_frame_indices_add_up():
    chunker, seen = FrameChunker(3, 5), []
    for i in range(20):
        chunk = chunker.add(torch.full((16,), i))
        if chunk is not None:
            assert chunker.sent - chunk.shape[0] == len(seen)  # the chunk's first frame index
            seen += chunk[:, 0].tolist()
    seen += chunker.flush()[:, 0].tolist()
    assert seen == list(range(20))
