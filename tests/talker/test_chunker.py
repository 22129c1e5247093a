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


FRAME_S = 0.08  # Qwen3-Omni: 1920 samples at 24 kHz


def cut(chunker: FrameChunker, times: list[float]) -> list[int]:
    """Feed one frame at each clock time; the sizes of the chunks that went out."""
    sizes = []
    for i, now in enumerate(times):
        chunk = chunker.add(torch.full((16,), i), now)
        if chunk is not None:
            sizes.append(chunk.shape[0])
    return sizes


def started(policy: ChunkPolicy) -> FrameChunker:
    """A chunker whose first chunk (4 frames, 0.32 s) went out, its audio up to the listener at t=0."""
    chunker = FrameChunker(policy, FRAME_S)
    assert cut(chunker, [-0.01] * 4) == [4]
    chunker.playing(0.0)
    return chunker


def test_a_chunk_goes_out_early_when_the_next_frame_would_come_too_late():
    chunker = started(ChunkPolicy(4, 25, growth=2, delivery_ms=100))
    # A frame every 50 ms: 8 frames would take 0.4 s while 0.32 s play. The audio runs out at
    # 0.32 s, a chunk needs 0.1 s to get there: a frame at 0.25 s would be too late.
    assert cut(chunker, [0.05, 0.10, 0.15]) == []
    assert cut(chunker, [0.20]) == [4]  # frames 4-7 now instead of 4-11 at 0.4 s
    assert chunker.sent == 8


def test_an_early_chunk_leaves_the_schedule_s_cuts_in_place():
    chunker = started(ChunkPolicy(4, 25, growth=2, delivery_ms=100))
    cut(chunker, [0.05, 0.10, 0.15, 0.20])  # 4 early: 8 frames (0.64 s) sent
    # A talker that caught up cuts at the schedule's 12 and 28 again, not 8 + 8.
    assert cut(chunker, [0.21] * 4) == [4]
    assert cut(chunker, [0.22] * 16) == [16]
    assert chunker.sent == 28


def test_a_talker_ahead_of_real_time_sends_the_schedule_s_chunks():
    chunker = started(DEFAULT_CHUNKS)
    times = [i * 0.02 for i in range(96)]  # 4x real time
    assert cut(chunker, times) + [chunker.flush().shape[0]] == [8, 16, 25, 25, 22]


def test_no_early_chunks_before_the_first_audio_without_a_frame_length_or_with_delivery_zero():
    late = [i * 0.2 for i in range(30)]  # far slower than real time
    not_playing = FrameChunker(DEFAULT_CHUNKS, FRAME_S)
    no_length = FrameChunker(DEFAULT_CHUNKS)
    no_length.playing(0.0)
    no_delivery = FrameChunker(ChunkPolicy(4, 25, delivery_ms=0), FRAME_S)
    no_delivery.playing(0.0)
    for chunker in (not_playing, no_length, no_delivery):
        assert cut(chunker, late) == [4, 8, 16]
