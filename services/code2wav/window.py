"""The window decoder (`--decoder window`): each block of frames (blocks.py) decoded by one vocoder
forward over the block and the `left_context` frames before it.

NOTE: algorithm. The vocoder is causal (vocoder.py, U and L), so a forward over frames [a, e)
returns the samples of the true answer at global positions [a*U, e*U - L), exactly, provided
frame a has enough frames before it. The window of the block of frames [f, f + n) is
[max(0, f - c), f + n): the
c = `left_context` frames before the block, then the block (its frames not received yet are zero
frames, blocks.py). It gives the L samples held back at the previous block's end (they depend on
frame b*size, so only this window can make them), then the block's own samples less its last L;
the context's own samples, emitted before, are dropped. Hence c >= ceil(L/U) = 1 frame.

The window start is a cut, so its first samples differ from the true answer (zero padding in the
convolutions, attention without the earlier frames); 25 frames of context cover the tiny
checkpoint's reach (~24 frames), so the emitted part matches there within float32 rounding. The
real vocoder (sliding window 72 over 8 layers) reaches ~580 frames back: 25 frames (the upstream
`chunked_decode` default) give ~3 dB SNR there, which is why the default decoder is
incremental.py's (docs/qwen3-omni.md, sections "The vocoder" and "Float32 and float64").

Windows sit on the block grid, so a window is a function of the block index and the frames, never
of the talker's cuts: its length is min(f, c) + n, one length for every block of the repeating
size once f >= c, and the windows of many requests batch (`forward_windows`: one eager forward, or
CUDA graphs per (length, batch bucket), graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from services.code2wav.blocks import Block, BlockGrid
from services.code2wav.vocoder import VocoderGeometry, forward_batch, model_device


def window_lengths(grid: BlockGrid, left_context: int) -> tuple[int, ...]:
    """Every window length the grid makes: min(f, c) + n for its blocks of frames [f, f + n)."""
    lengths, index = set(), 0
    while True:
        first = grid.first_frame(index)
        lengths.add(min(first, left_context) + grid.size(index))
        if first >= left_context and index >= len(grid.sizes) - 1:
            return tuple(sorted(lengths))
        index += 1


class WindowVocoder:
    """Blocks of several requests -> their windows' audio; no request state but the frames, which
    each block carries (`Block.context`)."""

    def __init__(self, model, geometry: VocoderGeometry, grid: BlockGrid, left_context: int = 25,
                 forward_windows: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if left_context < geometry.min_left_context:
            raise ValueError(
                f"left_context={left_context} frames cannot regenerate the {geometry.lookahead_samples} "
                f"held-back samples; need at least {geometry.min_left_context}"
            )
        self.model = model
        self.geometry = geometry
        self.grid = grid
        self.context = left_context  # frames a block's stream keeps before it
        self.num_quantizers = int(model.config.num_quantizers)
        # windows [G, n, Q] -> wav [G, n*U - L]: one eager forward, or replayed CUDA graphs.
        self.forward_windows = forward_windows or partial(forward_batch, model)
        self._device = model_device(model)

    rows_alone = True  # `decode(rows=True)` is each window's own forward: invariant by construction

    def start(self) -> None:
        return None  # the frames are the whole state

    def fork(self, state: None) -> None:
        return None

    def shape_key(self, index: int) -> int:
        """Blocks of equal key decode windows of equal length."""
        return min(self.grid.first_frame(index), self.context) + self.grid.size(index)

    def first_sample(self, block: Block) -> int:
        return (block.first_frame - block.context.shape[0]) * self.geometry.samples_per_frame

    @torch.inference_mode()
    def decode(self, blocks: list[Block], states: list[None], rows: bool = False) -> tuple[torch.Tensor, list[None]]:
        """Blocks of one `shape_key` -> (wav [G, n*U - L] on the host: one copy a call, no state).
        `rows`: one forward per window."""
        windows = torch.stack([torch.cat([b.context, b.frames]) for b in blocks]).to(self._device)  # [G, n, Q]
        if rows:
            wav = torch.cat([self.forward_windows(windows[i:i + 1]) for i in range(len(blocks))])
        else:
            wav = self.forward_windows(windows)
        return wav.cpu(), [None] * len(blocks)
