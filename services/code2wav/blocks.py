"""Codec frames on a fixed grid of blocks: what makes Qwen3-Omni's streamed audio independent of
how the talker cut the stream into chunks.

NOTE: why a grid. A CPU kernel's rounding depends on the shapes it is called with (a convolution
over 25 frames and the same frames as 4 + 21 differ in the last bits on AMD EPYC hosts), and on
where an element sits in the call (vectorised body or scalar tail). So the decoders never call the
vocoder on a chunk as it came: a request's frames are cut into blocks of `size` frames at fixed
places, block b holding frames [b*size, (b+1)*size), and every call decodes one whole block, its
frames not received yet replaced by zero frames. The vocoder is causal, so samples before
(b*size + real)*U - L never depend on those zero frames (vocoder.py: U, L); they are emitted, the
rest waits. When more frames of the block arrive, the block is decoded again from the same state
(the request's state is only ever the one after whole blocks): the same call on the same inputs,
so the samples already emitted come out with the same bits, and only the new ones are emitted.
Every call a frame ever takes part in is thus a function of the block index and the frames alone,
never of the cuts. (A chunk that ends mid-block costs one decode of that block again.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.code2wav.vocoder import EMPTY, VocoderGeometry


@dataclass(frozen=True)
class Block:
    """One decode of block `index`: frames [index*size, index*size + real) received, then zeros."""

    index: int
    frames: torch.Tensor  # [size, Q] int64: `real` frames, then zero frames
    real: int  # frames of the block received so far (1..size)
    context: torch.Tensor  # [c, Q] int64: the c frames just before the block (the window decoder's)

    @property
    def full(self) -> bool:
        return self.real == self.frames.shape[0]

    @property
    def first_frame(self) -> int:
        return self.index * self.frames.shape[0]


class BlockStream:
    """One request's frames on the grid: what arrived, which block decodes next, which samples are
    final. No model calls: the engine decodes the blocks (a batch of requests' at once) and hands
    each output back to `accept`."""

    def __init__(self, size: int, geometry: VocoderGeometry, context: int = 0):
        if size < 1:
            raise ValueError(f"block size must be at least 1 frame, got {size}")
        self.size = size
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
    def done(self) -> bool:
        return self.ended and not self.ready

    def next_block(self) -> Block:
        """The open block as far as it arrived (call when `ready`)."""
        start = self.blocks * self.size
        real = min(self.received - start, self.size)
        i = start - self._base
        frames = self._frames[i:i + real]
        if real < self.size:
            frames = torch.cat([frames, frames.new_zeros((self.size - real, frames.shape[1]))])
        context = self._frames[max(0, i - self.context):i]
        return Block(self.blocks, frames, real, context)

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
        keep_from = max(self._base, self.blocks * self.size - self.context)
        if keep_from > self._base:
            self._frames = self._frames[keep_from - self._base:].clone()
            self._base = keep_from


class StreamDecoder:
    """One request decoded on its own, synchronously, through a vocoder (incremental.py's or
    window.py's): push frames, get the samples now final. The engine (engine.py) does the same for
    many requests at once; this is its one-request form for tools and tests."""

    def __init__(self, vocoder):
        self.vocoder = vocoder
        self.stream = BlockStream(vocoder.size, vocoder.geometry, vocoder.context)
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
