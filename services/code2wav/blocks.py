"""Codec frames on a fixed grid of blocks: what makes Qwen3-Omni's streamed audio independent of
how the talker cut the stream into chunks.

NOTE: why a grid. A CPU kernel's rounding depends on the shapes it is called with (a convolution
over 25 frames and the same frames as 4 + 21 differ in the last bits on AMD EPYC hosts), and on
where an element sits in the call (vectorised body or scalar tail). So the decoders never call the
vocoder on a chunk as it came: a request's frames are cut into blocks at fixed places (`BlockGrid`:
the talker's chunk schedule by default, 4, 8, 16, then 25 frames a block), and every call decodes
one whole block, its frames not received yet replaced by zero frames. The vocoder is causal, so
samples before (first + real)*U - L never depend on those zero frames (vocoder.py: U, L); they are
emitted, the rest waits. When more frames of the block arrive, the block is decoded again from the
same state (the request's state is only ever the one after whole blocks): the same call on the
same inputs, so the samples already emitted come out with the same bits, and only the new ones are
emitted. Every call a frame ever takes part in is thus a function of the grid and the frames alone,
never of the cuts.

NOTE: why the talker's schedule. A talker that keeps to its schedule sends whole blocks: one call
a chunk, as many as decoding the chunks as they came. A chunk cut early (the talker running dry,
services/runtime/chunking.py) leaves an open block, decoded again when its next frames come: the
engine decodes an open block only when its listener needs the audio (engine.py), so a block is
decoded a second time only where the listener would otherwise have waited.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.code2wav.vocoder import EMPTY, VocoderGeometry


@dataclass(frozen=True)
class BlockGrid:
    """Where blocks start: `sizes` frames each, in order, the last size repeating."""

    sizes: tuple[int, ...]

    def __post_init__(self):
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"block sizes must be at least 1 frame, got {list(self.sizes)}")

    def first_frame(self, index: int) -> int:
        head = self.sizes[:index]
        return sum(head) + max(0, index - len(self.sizes)) * self.sizes[-1]

    def size(self, index: int) -> int:
        return self.sizes[min(index, len(self.sizes) - 1)]

    def __str__(self) -> str:
        return ",".join(map(str, self.sizes))


ONE_FRAME = BlockGrid((1,))


@dataclass(frozen=True)
class Block:
    """One decode of block `index`: frames [first_frame, first_frame + real) received, then zeros."""

    index: int
    first_frame: int
    frames: torch.Tensor  # [size, Q] int64: `real` frames, then zero frames
    real: int  # frames of the block received so far (1..size)
    context: torch.Tensor  # [c, Q] int64: the c frames just before the block (the window decoder's)

    @property
    def full(self) -> bool:
        return self.real == self.frames.shape[0]


class BlockStream:
    """One request's frames on the grid: what arrived, which block decodes next, which samples are
    final. No model calls: the engine decodes the blocks (a batch of requests' at once) and hands
    each output back to `accept`."""

    def __init__(self, grid: BlockGrid, geometry: VocoderGeometry, context: int = 0):
        self.grid = grid
        self.geometry = geometry
        self.context = context  # frames before a block that its decode reads (the window decoder's)
        self._frames: torch.Tensor | None = None  # [k, Q] int64: received frames from _base on
        self._base = 0  # global index of _frames[0]
        self.received = 0
        self.blocks = 0  # blocks decoded whole: the request's state is the one after them
        self.covered = 0  # frames covered by decodes so far (whole blocks, then the open block's)
        self.samples_emitted = 0
        self.ended = False

    def push(self, frames: torch.Tensor) -> None:
        """frames [n, Q] int64, in order."""
        if frames.shape[0] == 0:
            return
        frames = frames.to(torch.long)
        self._frames = frames.clone() if self._frames is None else torch.cat([self._frames, frames])
        self.received += frames.shape[0]

    def end(self) -> None:
        self.ended = True

    @property
    def ready(self) -> bool:
        """Frames arrived that no decode covers yet: the next block has work."""
        return self.received > self.covered

    @property
    def whole(self) -> bool:
        """The next block has all its frames (or the stream ended): deciding it cannot wait."""
        return self.ready and (self.ended or self.received >= self.grid.first_frame(self.blocks + 1))

    @property
    def done(self) -> bool:
        return self.ended and not self.ready

    def next_block(self) -> Block:
        """The open block as far as it arrived (call when `ready`)."""
        start, size = self.grid.first_frame(self.blocks), self.grid.size(self.blocks)
        real = min(self.received - start, size)
        i = start - self._base
        frames = self._frames[i:i + real]
        if real < size:
            frames = torch.cat([frames, frames.new_zeros((size - real, frames.shape[1]))])
        context = self._frames[max(0, i - self.context):i]
        return Block(self.blocks, start, frames, real, context)

    def accept(self, block: Block, wav: torch.Tensor, first_sample: int) -> np.ndarray:
        """`wav`: the decode of `block`, global samples [first_sample, first_sample + len). Returns
        the samples that are final now and not emitted before (float32)."""
        U, L = self.geometry.samples_per_frame, self.geometry.lookahead_samples
        final = (block.first_frame + block.real) * U - L  # samples after it wait for later frames
        out = EMPTY.copy()
        if final > self.samples_emitted:
            out = wav[self.samples_emitted - first_sample:final - first_sample].float().cpu().numpy()
            self.samples_emitted = final
        self.covered = block.first_frame + block.real
        if block.full:
            self.blocks += 1
            self._trim()
        return out

    def _trim(self) -> None:
        # Keep what the next block's decode reads: its own frames and the `context` before them.
        keep_from = max(self._base, self.grid.first_frame(self.blocks) - self.context)
        if keep_from > self._base:
            self._frames = self._frames[keep_from - self._base:].clone()
            self._base = keep_from


class StreamDecoder:
    """One request decoded on its own, synchronously, through a vocoder (incremental.py's or
    window.py's): push frames, get the samples now final. The engine (engine.py) does the same for
    many requests at once; this is its one-request form for tools and tests."""

    def __init__(self, vocoder):
        self.vocoder = vocoder
        self.stream = BlockStream(vocoder.grid, vocoder.geometry, vocoder.context)
        self.state = vocoder.start()

    @property
    def frames_seen(self) -> int:
        return self.stream.received

    @property
    def samples_emitted(self) -> int:
        return self.stream.samples_emitted

    def push(self, frames: torch.Tensor) -> np.ndarray:
        """frames [n, Q] int64 -> the float32 samples that are now final."""
        if frames.dim() != 2 or frames.shape[1] != self.vocoder.num_quantizers:
            raise ValueError(f"expected frames [n, {self.vocoder.num_quantizers}], got {list(frames.shape)}")
        if self.stream.ended:
            raise RuntimeError("push() after finish()")
        self.stream.push(frames)
        out = []
        while self.stream.ready:
            block = self.stream.next_block()
            wav, after = self.vocoder.decode([block], [self.state])
            out.append(self.stream.accept(block, wav[0], self.vocoder.first_sample(block)))
            self.state = after[0] if after[0] is not None else self.state
        return np.concatenate(out) if out else EMPTY.copy()

    def finish(self) -> np.ndarray:
        """One forward trims the samples that need later frames, and so does each block: nothing
        is pending at the end."""
        self.stream.end()
        return EMPTY.copy()
