"""The chunk policy (services/runtime/chunking.py): the talker's chunks and code2wav's graph windows."""

from __future__ import annotations

import torch

from services.runtime.chunking import DEFAULT_CHUNKS, ChunkPolicy, FrameChunker


def chunk_sizes(chunker: FrameChunker, frames: int) -> list[int]:
    sizes = []
    for i in range(frames):
        chunk = chunker.add(torch.full((16,), i))
        if chunk is not None:
            sizes.append(chunk.shape[0])
    tail = chunker.flush()
    return sizes + ([tail.shape[0]] if tail is not None else [])


def test_chunks_double_from_the_first_up_to_the_steady_size_and_the_tail_is_flushed():
    assert chunk_sizes(FrameChunker(ChunkPolicy(4, 25, growth=2)), 100) == [4, 8, 16, 25, 25, 22]


def test_growth_one_goes_straight_from_the_first_chunk_to_the_steady_size():
    assert chunk_sizes(FrameChunker(ChunkPolicy(4, 25, growth=1)), 60) == [4, 25, 25, 6]


def test_frames_keep_their_order_and_first_frame_indices_add_up():
    chunker, seen = FrameChunker(ChunkPolicy(3, 5)), []
    for i in range(20):
        chunk = chunker.add(torch.full((16,), i))
        if chunk is not None:
            assert chunker.sent - chunk.shape[0] == len(seen)  # the chunk's first frame index
            seen += chunk[:, 0].tolist()
    seen += chunker.flush()[:, 0].tolist()
    assert seen == list(range(20))


def test_policy_sizes_are_what_the_chunker_cuts():
    for policy, frames in ((DEFAULT_CHUNKS, 100), (ChunkPolicy(4, 25, growth=1), 60), (ChunkPolicy(3, 5), 20)):
        assert policy.sizes(frames) == chunk_sizes(FrameChunker(policy), frames)


def test_graph_windows_follow_the_chunks_with_their_left_context():
    # 4 | 4 + 8 | 12 + 16 | min(25, 28) + 25 | 25 + 25 ...
    assert DEFAULT_CHUNKS.windows(25) == (4, 12, 28, 50)
    assert ChunkPolicy(4, 25, growth=1).windows(25) == (4, 29, 50)
