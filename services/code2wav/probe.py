"""The start-up probe of Qwen3-Omni's code2wav: which block grid and which batches keep every
request's audio the bits it gets alone and uncut, on this machine.

A decode's bits depend on the shapes its kernels run (blocks.py, the NOTE); by construction the
block grid fixes them per request. Two things remain properties of the machine's kernels, so the
engine checks them once, its model loaded and its thread count set, bitwise, and adopts only what
matched (a failed probe costs speed, never a request; anything that raises counts as a mismatch):

- an open block: decoding a block with its missing frames as zero frames must not change the
  samples of the frames it has (the kernels compute each output from its own inputs). Frames fed
  one at a time must give the bits of frames fed a block at a time, through every size of the
  grid. Where they do not, blocks are one frame: no open block ever exists, every call has one
  shape.
- a batch: several requests' blocks decoded in one call must each give the bits of that block
  decoded alone, for every shape the vocoder decodes (`shape_classes`) at the batch sizes where
  kernel heuristics switch (services/runtime/invariance.py's `probe_batches`). First all ops
  batched; where some size differs, again with the dense convolutions one row at a time (the ops
  whose CPU kernels block by batch: measured on AMD EPYC, everything else matched). Sizes that
  match neither way are never used; a step decodes the largest allowed size of ready blocks.

The choice is logged once and exported (`omni_exact_kernel_info{stage="code2wav"}` and
`omni_exact_setting`, services/serving/metrics.py). Without exact mode (`--exact-batching off`,
the default off the CPU) nothing is probed: the grid as configured, every batch size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from services.code2wav.blocks import ONE_FRAME, Block, BlockGrid, BlockStream, StreamDecoder
from services.runtime.invariance import probe_batches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockPlan:
    """What the engine runs: blocks on `grid`, batches of the sizes in `batches`, the dense
    convolutions per row where `rows`."""

    grid: BlockGrid
    batches: tuple[int, ...] = (1,)  # increasing, 1 first
    rows: bool = False
    reasons: dict[str, str] = field(default_factory=dict)  # "block" / "batch" -> why
    seconds: float = 0.0
    max_frames: int = 0  # frames a call decodes at most, over its whole batch (0: no bound)

    def batch_for(self, ready: int, block_frames: int) -> int:
        """The largest allowed batch of at most `ready` blocks of `block_frames` frames each, within
        `max_frames` (one block at least)."""
        limit = min(ready, self.max_frames // block_frames) if self.max_frames else ready
        return max(b for b in self.batches if b <= max(limit, 1))

    def paths(self) -> dict[str, str]:
        """op -> path, for omni_exact_kernel_info."""
        return {"conv": "rows" if self.rows else "batched",
                "vocoder": "batched" if len(self.batches) > 1 else "alone"}

    def settings(self) -> dict[str, float]:
        return {"first_block_frames": self.grid.sizes[0], "block_frames": self.grid.sizes[-1],
                "max_batch": self.batches[-1]}

    def line(self) -> str:
        return "; ".join(f"{name}: {why}" for name, why in self.reasons.items())


def shape_classes(vocoder) -> list[int]:
    """The first block index of each shape the vocoder decodes (its keys stop changing once warm)."""
    seen, indices, index = set(), [], 0
    while (key := vocoder.shape_key(index)) not in seen:
        seen.add(key)
        indices.append(index)
        index += 1
    return indices


def _frames(vocoder, n: int, seed: int) -> torch.Tensor:
    codebook = int(vocoder.model.config.codebook_size)
    return torch.randint(0, codebook, (n, vocoder.num_quantizers), generator=torch.Generator().manual_seed(seed))


def open_blocks_keep_their_bits(vocoder, seed: int = 0) -> str | None:
    """None if frames fed one at a time decode to the bits of frames fed a block at a time."""
    grid = vocoder.grid
    frames = _frames(vocoder, grid.first_frame(len(grid.sizes)) + 1, seed)  # every size, then an open block
    whole = StreamDecoder(vocoder).push(frames)
    one_by_one = StreamDecoder(vocoder)
    parts = [one_by_one.push(frames[i:i + 1]) for i in range(frames.shape[0])]
    if np.array_equal(whole, np.concatenate(parts)):
        return None
    return f"an open block of the grid {grid} changed the bits of the frames it had"


@dataclass
class _Case:
    block: Block
    state: object
    wav: torch.Tensor  # [T]: the block decoded alone


class _Cases:
    """Random streams, each decoded alone block by block up to the last of `indices`: the blocks
    at `indices` with the state before them and their audio. Made as the probe asks for them (a
    probe that fails at batch 2 decodes two streams, not sixteen)."""

    def __init__(self, vocoder, indices: list[int], seed: int):
        self.vocoder, self.indices, self.seed = vocoder, indices, seed
        self.by_index: dict[int, list[_Case]] = {i: [] for i in indices}

    def first(self, n: int) -> dict[int, list[_Case]]:
        while len(self.by_index[self.indices[0]]) < n:
            self._decode_one(self.seed + 1 + len(self.by_index[self.indices[0]]))
        return {i: cases[:n] for i, cases in self.by_index.items()}

    def _decode_one(self, seed: int) -> None:
        vocoder = self.vocoder
        stream = BlockStream(vocoder.grid, vocoder.geometry, vocoder.context)
        stream.push(_frames(vocoder, vocoder.grid.first_frame(self.indices[-1] + 1), seed))
        state = vocoder.start()
        for index in range(self.indices[-1] + 1):
            block = stream.next_block()
            wav, after = vocoder.decode([block], [state])
            if index in self.by_index:
                self.by_index[index].append(_Case(block, state, wav[0]))
            stream.accept(block, wav[0], vocoder.first_sample(block))
            state = after[0]


def _batch_matches(vocoder, cases: _Cases, size: int, rows: bool) -> bool:
    for batch in cases.first(size).values():
        wav, _ = vocoder.decode([c.block for c in batch], [c.state for c in batch], rows=rows)
        if not all(torch.equal(wav[i], c.wav) for i, c in enumerate(batch)):
            return False
    return True


def batches_keep_their_bits(vocoder, capacity: int, seed: int = 0) -> tuple[tuple[int, ...], bool, str]:
    """(allowed batch sizes, rows, why): every probed size with all ops batched if all match so;
    else the sizes that match with the vocoder's rows path (`rows_alone`: a vocoder whose rows path
    is each request's own call needs no probe for it)."""
    sizes = probe_batches(capacity)
    if not sizes:
        return (1,), False, "one request a call (--max-batch 1)"
    cases = _Cases(vocoder, shape_classes(vocoder), seed)
    differs = next((s for s in sizes if not _guarded(_batch_matches, vocoder, cases, s, False)), None)
    if differs is None:
        return (1, *sizes), False, f"batched decodes matched each request alone at batch {_span(sizes)}"
    why = f"batched decodes differed from a request alone at batch {differs}"
    if vocoder.rows_alone:
        return (1, *sizes), True, f"{why}: each request's own call in a batch"
    rows = [s for s in sizes if _guarded(_batch_matches, vocoder, cases, s, True)]
    if rows:
        return (1, *rows), True, f"{why}; with convolutions per row batch {_span(rows)} matched"
    return (1,), False, f"{why}, with convolutions per row too: one request a call"


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}-{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])


def _guarded(check: Callable[..., bool], *args) -> bool:
    try:
        return check(*args)
    except Exception:  # noqa: BLE001 - a probe that cannot run means: not invariant here
        log.exception("code2wav probe failed")
        return False


def plan_blocks(make_vocoder: Callable[[BlockGrid], object], grid: BlockGrid, capacity: int,
                exact: bool, max_frames: int = 0) -> tuple[object, BlockPlan]:
    """The vocoder to serve with (`make_vocoder(grid)`) and its plan; logged once. `max_frames`
    bounds a call's frames over its whole batch (0: no bound)."""
    started = time.perf_counter()
    vocoder = make_vocoder(grid)
    if not exact:
        plan = BlockPlan(grid, tuple(range(1, capacity + 1)), False,
                         {"block": f"blocks of {grid} frames, not probed", "batch": f"any up to {capacity}, not probed"},
                         max_frames=max_frames)
        return vocoder, plan
    reasons = {"block": f"blocks of {grid} frames: an open block keeps the bits of its frames"}
    why = None
    if grid != ONE_FRAME:
        try:
            why = open_blocks_keep_their_bits(vocoder)
        except Exception as e:  # noqa: BLE001 - see _guarded
            why = f"probe failed: {type(e).__name__}: {e}"
    if why is not None:
        vocoder, grid = make_vocoder(ONE_FRAME), ONE_FRAME
        reasons["block"] = f"blocks of 1 frame ({why})"
    batches, rows, reasons["batch"] = batches_keep_their_bits(vocoder, capacity)
    plan = BlockPlan(grid, batches, rows, reasons, time.perf_counter() - started, max_frames)
    log.info("code2wav blocks on this CPU (%s, %d thread(s)), probed in %.2f s: %s",
             torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), plan.seconds, plan.line())
    return vocoder, plan
