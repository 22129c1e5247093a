"""What Qwen3-Omni's code2wav engine runs (`BlockPlan`), and exact mode's check of the faster plan.

A decode's bits depend on the shapes its kernels run (blocks.py, the NOTE); the block grid fixes
them per request. Two things remain properties of the machine's kernels, so exact mode serves on
the plan that needs neither (`BlockPlan.by_construction`: one request a call, an open block
decoded only at its stream's end) and checks both beside serving (services/runtime/checks.py),
bitwise, adopting only what matched (anything that raises counts as a mismatch):

- an open block: decoding a block with its missing frames as zero frames must not change the
  samples of the frames it has (the kernels compute each output from its own inputs). Frames fed
  one at a time must give the bits of frames fed a block at a time, through every size of the
  grid: every (block shape, frames received) pair once. Where they do not, an open block waits
  for its frames (or its stream's end): the talker's early cuts then bring no audio sooner.
- a batch: several requests' blocks decoded in one call must each give the bits of that block
  decoded alone, for every shape the vocoder decodes (`shape_classes`) at the batch sizes where
  kernel heuristics switch (services/runtime/lm/invariance.py's `check_batch_sizes`) that the engine can
  run for that shape (a call decodes at most `max_frames` frames: blocks of 25 frames go two a
  call on a CPU, so the larger sizes are never checked there), all ops batched. Where a size
  differs (on AVX512 oneDNN's convolutions block by batch), the vocoder's rows path: every row
  kept apart by construction for the vocoders that say so (`rows_alone`: both Qwen3-Omni
  decoders, `kernels.rows_apart`), else checked too. Sizes that match neither way are never used;
  a step decodes the largest allowed size of ready blocks.

Both are bitwise properties of a kernel and the shapes it is called with, not of the weights'
values nor of how many times a layer repeats: docs/architecture.md, "What the check must run".
The verdict is logged once, exported (`omni_exact_kernel_info{stage="code2wav"}`,
`omni_exact_setting`, `omni_exact_check`) and kept on disk for the machine. Without exact mode
(`--exact-batching off`, the default off the CPU) nothing is checked: every batch size, open
blocks decoded when due.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from services.base.stages import Stage
from services.code2wav.blocks import Block, BlockGrid, BlockStream, StreamDecoder
from services.runtime.checks import CheckState, StartupCheck
from services.runtime.lm.invariance import check_batch_sizes
from services.runtime.model.settings import CheckSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockPlan:
    """What the engine runs: blocks on `grid`, batches of the sizes in `batches`, the dense
    convolutions per row where `rows`, an open block decoded when its listener needs it where
    `open_blocks` (else only once whole or at its stream's end)."""

    grid: BlockGrid
    batches: tuple[int, ...] = (1,)  # increasing, 1 first
    rows: bool = False
    open_blocks: bool = True
    reasons: dict[str, str] = field(default_factory=dict)  # "block" / "batch" -> why
    max_frames: int = 0  # frames a call decodes at most, over its whole batch (0: no bound)
    check: CheckState = CheckState.NONE  # where the plan came from (omni_exact_check)

    @classmethod
    def by_construction(cls, grid: BlockGrid, max_frames: int = 0) -> BlockPlan:
        """Exact on any machine: every call one request's whole block (an open block only at its
        stream's end, when it is as whole as it gets), so every call a frame takes part in has the
        shape and inputs it has alone, uncut."""
        return cls(grid, (1,), False, False, {"block": f"blocks of {grid} frames, an open block decoded at its "
                                                       "stream's end", "batch": "one request a call"}, max_frames)

    def batch_for(self, ready: int, block_frames: int) -> int:
        """The largest allowed batch of at most `ready` blocks of `block_frames` frames each, within
        `max_frames` (one block at least)."""
        return max(b for b in self.batches if b <= max(self.limit(block_frames, ready), 1))

    def limit(self, block_frames: int, ready: int | None = None) -> int:
        """Blocks of `block_frames` frames a call may decode (of `ready` ones)."""
        limit = ready if ready is not None else max(self.batches[-1], 1 << 30)
        return min(limit, self.max_frames // block_frames) if self.max_frames else limit

    def paths(self) -> dict[str, str]:
        """op -> path, for omni_exact_kernel_info."""
        return {"conv": "rows" if self.rows else "batched",
                "vocoder": "batched" if len(self.batches) > 1 else "alone",
                "open_block": "when_due" if self.open_blocks else "when_whole"}

    def settings(self) -> dict[str, float]:
        return {"first_block_frames": self.grid.sizes[0], "block_frames": self.grid.sizes[-1],
                "max_batch": self.batches[-1], "open_blocks": int(self.open_blocks)}

    def line(self) -> str:
        return "; ".join(f"{name}: {why}" for name, why in self.reasons.items())

    def to_json(self) -> dict:
        return {"batches": list(self.batches), "rows": self.rows, "open_blocks": self.open_blocks,
                "reasons": dict(self.reasons)}

    def with_verdict(self, verdict: dict, check: CheckState) -> BlockPlan:
        """This plan with a check's verdict (`to_json`'s) adopted."""
        batches = tuple(int(b) for b in verdict["batches"])
        if not batches or batches[0] != 1 or list(batches) != sorted(set(batches)):
            raise ValueError(f"batches must increase from 1, got {list(batches)}")
        return dataclasses.replace(self, batches=batches, rows=bool(verdict["rows"]),
                                   open_blocks=bool(verdict["open_blocks"]),
                                   reasons={str(k): str(v) for k, v in verdict["reasons"].items()}, check=check)


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
    state: object  # before the block, decoded only through copies (`fork`): it stays so
    wav: torch.Tensor  # [T]: the block decoded alone


class _Stream:
    """A random stream decoded alone block by block, as far as the cases asked of it."""

    def __init__(self, vocoder, blocks: int, seed: int):
        self.vocoder = vocoder
        self.blocks = BlockStream(vocoder.grid, vocoder.geometry, vocoder.context)
        self.blocks.push(_frames(vocoder, vocoder.grid.first_frame(blocks), seed))
        self.state = vocoder.start()
        self.cases: dict[int, _Case] = {}  # block index -> that block with the state before it

    def case(self, index: int) -> _Case:
        while index not in self.cases:
            block = self.blocks.next_block()
            before = self.vocoder.fork(self.state)  # the decode advances the state in place
            wav, after = self.vocoder.decode([block], [self.state])
            self.cases[block.index] = _Case(block, before, wav[0])
            self.blocks.accept(block, wav[0], self.vocoder.first_sample(block))
            self.state = after[0]
        return self.cases[index]


class _Cases:
    """Streams decoded alone, made as the check asks for them: a check of batch 2 at the last
    shape decodes two streams that far, not sixteen."""

    def __init__(self, vocoder, indices: list[int], seed: int):
        self.vocoder, self.blocks, self.seed = vocoder, indices[-1] + 1, seed
        self._streams: list[_Stream] = []

    def first(self, index: int, n: int) -> list[_Case]:
        while len(self._streams) < n:
            self._streams.append(_Stream(self.vocoder, self.blocks, self.seed + 1 + len(self._streams)))
        return [stream.case(index) for stream in self._streams[:n]]


def _batch_matches(vocoder, cases: _Cases, index: int, size: int, rows: bool) -> bool:
    batch = cases.first(index, size)
    wav, _ = vocoder.decode([c.block for c in batch], [vocoder.fork(c.state) for c in batch], rows=rows)
    return all(torch.equal(wav[i], c.wav) for i, c in enumerate(batch))


def batches_keep_their_bits(vocoder, capacity: int, max_frames: int = 0, seed: int = 0
                            ) -> tuple[tuple[int, ...], bool, str]:
    """(allowed batch sizes, rows, why): every checked size with all ops batched if all match so;
    else the sizes that match with the vocoder's rows path (`rows_alone`: a vocoder whose rows path
    is each request's own call needs no check for it). A size is checked at each shape whose calls
    can hold it (`max_frames`), and used only where it matched at all of them."""
    bound = BlockPlan(vocoder.grid, max_frames=max_frames)
    classes = shape_classes(vocoder)
    usable = {i: [s for s in check_batch_sizes(capacity) if s <= bound.limit(vocoder.grid.size(i))] for i in classes}
    sizes = sorted({s for sizes in usable.values() for s in sizes})
    if not sizes:
        return (1,), False, ("one request a call (--max-batch 1)" if capacity < 2 else
                             f"one request a call (--max-batch-frames {max_frames} holds one block)")
    cases = _Cases(vocoder, classes, seed)

    def matches(size: int, rows: bool) -> bool:
        return all(_guarded(_batch_matches, vocoder, cases, i, size, rows) for i in classes if size in usable[i])

    differs = next((s for s in sizes if not matches(s, False)), None)
    if differs is None:
        return (1, *sizes), False, f"batched decodes matched each request alone at batch {_span(sizes)}"
    why = f"batched decodes differed from a request alone at batch {differs}"
    if vocoder.rows_alone:
        return (1, *sizes), True, f"{why}: each request's own call in a batch"
    rows = [s for s in sizes if matches(s, True)]
    if rows:
        return (1, *rows), True, f"{why}; with convolutions per row batch {_span(rows)} matched"
    return (1,), False, f"{why}, with convolutions per row too: one request a call"


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}-{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])


def _guarded(check: Callable[..., bool], *args) -> bool:
    try:
        return check(*args)
    except Exception:  # noqa: BLE001 - a check that cannot run means: not invariant here
        log.exception("code2wav batch check failed")
        return False


def check_blocks(vocoder, capacity: int, max_frames: int) -> BlockPlan:
    """The verdict of both checks on `vocoder` (one of the serving vocoder's kind, not the serving
    one: its rotary table grows as it decodes)."""
    plan = BlockPlan(vocoder.grid, max_frames=max_frames)
    try:
        why = open_blocks_keep_their_bits(vocoder)
    except Exception as e:  # noqa: BLE001 - see _guarded
        why = f"check failed: {type(e).__name__}: {e}"
    batches, rows, batch_why = batches_keep_their_bits(vocoder, capacity, max_frames)
    block_why = (f"blocks of {vocoder.grid} frames: an open block keeps the bits of its frames" if why is None else
                 f"blocks of {vocoder.grid} frames, an open block decoded once whole ({why})")
    return dataclasses.replace(plan, batches=batches, rows=rows, open_blocks=why is None,
                               reasons={"block": block_why, "batch": batch_why}, check=CheckState.CHECKED)


def plan_blocks(make_vocoder: Callable[[BlockGrid], object], grid: BlockGrid, capacity: int, exact: bool,
                max_frames: int = 0, checks: CheckSettings = CheckSettings()
                ) -> tuple[object, BlockPlan, StartupCheck | None]:
    """The vocoder to serve with (`make_vocoder(grid)`), the plan to start on, and the check that
    may adopt a faster one (None: nothing to check). `max_frames` bounds a call's frames over its
    whole batch (0: no bound)."""
    vocoder = make_vocoder(grid)
    if not exact:
        plan = BlockPlan(grid, tuple(range(1, capacity + 1)), False, True,
                         {"block": f"blocks of {grid} frames, not checked", "batch": f"any up to {capacity}, not checked"},
                         max_frames)
        return vocoder, plan, None
    safe = BlockPlan.by_construction(grid, max_frames)
    shapes = {"vocoder": vocoder.model.config.to_dict(), "decoder": type(vocoder).__name__,
              "context": vocoder.context, "grid": list(grid.sizes), "capacity": capacity, "max_frames": max_frames,
              "dtype": str(next(vocoder.model.parameters()).dtype)}
    check = StartupCheck(f"{Stage.CODE2WAV} blocks", shapes, lambda: check_blocks(make_vocoder(grid), capacity, max_frames),
                         BlockPlan.to_json, lambda verdict: safe.with_verdict(verdict, CheckState.CACHED), checks)
    plan = dataclasses.replace(check.start() or safe, check=check.state)
    if check.state is not CheckState.RUNNING:
        log_plan(plan, check)
    return vocoder, plan, check


def adopt(plan: BlockPlan, check: StartupCheck | None) -> BlockPlan | None:
    """The plan a check beside serving ended with, once, logged: its verdict, or `plan` marked
    failed. None before then, and after."""
    if check is None or not check.ended():
        return None
    adopted = dataclasses.replace(check.verdict or plan, check=check.state)
    log_plan(adopted, check)
    return adopted


def log_plan(plan: BlockPlan, check: StartupCheck) -> None:
    how = {CheckState.CACHED: "kept on disk", CheckState.FAILED: "check failed, unchanged"}.get(
        check.state, f"checked in {check.seconds:.2f} s")
    log.info("code2wav blocks on this CPU (%s, %d thread(s)), %s: %s", torch.backends.cpu.get_cpu_capability(),
             torch.get_num_threads(), how, plan.line())
