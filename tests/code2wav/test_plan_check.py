"""Code2wav serves at once on the plan exact by construction and adopts its check's faster plan
between steps (services/code2wav/plan.py, engine.py): a stream that spans the switch gets the bits
it gets alone; a check that raises leaves one request a call; the check decodes no batch a call
could not hold; its verdict is kept for the next start."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from services.code2wav.blocks import BlockGrid, StreamDecoder
from services.code2wav.engine import Code2WavEngine
from services.code2wav.incremental import IncrementalVocoder
from services.code2wav.plan import batches_keep_their_bits, plan_blocks
from services.code2wav.vocoder import measure_geometry
from services.runtime.checks import CheckState
from services.runtime.chunking import DEFAULT_CHUNKS
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.settings import CheckSettings
from tests.code2wav.test_blocks import run_engine

GRID = BlockGrid(DEFAULT_CHUNKS.schedule())


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_stage(tiny_checkpoint, Stage.CODE2WAV)


class Gated:
    """make_vocoder for plan_blocks: the serving vocoder at once, the check's only once `gate` opens
    (or raising `error`)."""

    def __init__(self, loaded, error: Exception | None = None):
        self.loaded, self.error = loaded, error
        self.geometry = measure_geometry(loaded.model)
        self.gate = threading.Event()
        self.made = 0

    def __call__(self, grid: BlockGrid) -> IncrementalVocoder:
        self.made += 1
        if self.made > 1:  # the check's, on its thread
            assert self.gate.wait(60)
            if self.error is not None:
                raise self.error
        return IncrementalVocoder(self.loaded.model, self.geometry, grid)


def codes(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))


def alone(loaded, frames: torch.Tensor) -> np.ndarray:
    return StreamDecoder(IncrementalVocoder(loaded.model, measure_geometry(loaded.model), GRID)).push(frames)


def feed(engine, frames: dict[str, torch.Tensor], start: int, stop: int, steps: int, audio: dict) -> None:
    from services.code2wav.engine import Audio, CodecChunk

    for request_id, codes_ in frames.items():
        engine.add_input(request_id, CodecChunk(codes_[start:stop]))
    for _ in range(steps):
        for request_id, event in engine.step():
            if isinstance(event, Audio):
                audio[request_id].append(event.samples)


@pytest.mark.slow  # 10 s: the start-up check runs under live streams: make test-slow (CI)
@pytest.mark.exactness
def test_streams_that_span_the_switch_to_the_checked_plan_get_their_alone_bits(loaded, tmp_path):
    make = Gated(loaded)
    vocoder, plan, check = plan_blocks(make, GRID, 16, exact=True, max_frames=64,
                                       checks=CheckSettings(background=True, cache=str(tmp_path)))
    engine = Code2WavEngine(vocoder, plan, loaded.config, check=check)
    assert (plan.batches, plan.open_blocks, plan.check) == ((1,), False, CheckState.RUNNING)
    frames = {f"r{i}": codes(i, 61) for i in range(4)}
    audio: dict[str, list] = {r: [] for r in frames}
    for request_id in frames:
        engine.add(request_id)
    feed(engine, frames, 0, 13, 6, audio)  # blocks 0 and 1 whole, block 2 open: it waits
    assert engine.plan.batches == (1,) and engine.queue_depth == 4
    make.gate.set()
    assert check.wait(120)
    feed(engine, frames, 13, 30, 1, audio)  # the step adopts the checked plan first
    assert engine.plan.check is CheckState.CHECKED and engine.plan.batches[-1] > 1 and engine.plan.open_blocks
    from services.code2wav.engine import CodecEnd

    feed(engine, frames, 30, 61, 0, audio)
    for request_id in frames:
        engine.add_input(request_id, CodecEnd())
    while engine.has_work():
        feed(engine, {}, 0, 0, 1, audio)
    for request_id, codes_ in frames.items():
        assert np.array_equal(np.concatenate(audio[request_id]), alone(loaded, codes_)), request_id
    # A restart on this machine adopts the kept verdict before its first request.
    _, kept, again = plan_blocks(Gated(loaded), GRID, 16, exact=True, max_frames=64,
                                 checks=CheckSettings(background=True, cache=str(tmp_path)))
    assert kept.check is CheckState.CACHED and kept.batches == engine.plan.batches and again.ended() is False


def test_a_check_that_raises_leaves_one_request_a_call_and_the_engine_serving(loaded, caplog):
    make = Gated(loaded, error=RuntimeError("out of memory in the check"))
    vocoder, plan, check = plan_blocks(make, GRID, 16, exact=True, max_frames=64,
                                       checks=CheckSettings(background=True))
    engine = Code2WavEngine(vocoder, plan, loaded.config, check=check)
    make.gate.set()
    assert check.wait(60)
    frames = codes(9, 30)
    assert np.array_equal(run_engine(engine, {"a": (frames, [4, 8, 18])})["a"], alone(loaded, frames))
    assert engine.plan.check is CheckState.FAILED and engine.plan.batches == (1,) and not engine.plan.open_blocks
    assert "the check failed; the plan invariant by construction stays" in caplog.text


class Recording(IncrementalVocoder):
    """Every batch keeps its bits (its rows kept apart, exact on any CPU), so the check runs every
    size a call can hold whatever this host's batched kernels do (on AVX512 all-batched differs at
    2, and the check stops there)."""

    calls: list[tuple[int, int]]  # (blocks, frames a block) of every decode

    def decode(self, blocks, states, rows=False):
        self.calls.append((len(blocks), blocks[0].frames.shape[0]))
        return super().decode(blocks, states, rows=True)


@pytest.mark.slow  # 9 s: the whole start-up check: make test-slow (CI)
def test_the_check_decodes_no_batch_a_call_could_not_hold(loaded):
    frames = {}
    for max_frames in (64, 0):
        vocoder = Recording(loaded.model, measure_geometry(loaded.model), GRID)
        vocoder.calls = []
        batches, _, _ = batches_keep_their_bits(vocoder, 16, max_frames)
        assert batches[-1] == 16
        batched = [blocks * size for blocks, size in vocoder.calls if blocks > 1]
        assert max(batched) == (max_frames or 16 * 25)  # 25-frame blocks go two a call: 3-16 never run there
        frames[max_frames] = sum(blocks * size for blocks, size in vocoder.calls)
    # Bounded by what a call holds (the 9 sizes at blocks of 4, 6 at 8, 3 at 16, 1 at 25: 702 frames
    # batched), and each stream decoded alone only as far as a case needs it (16 streams to the
    # 4-frame block, 8 to the 8-frame one, 4 to 16, 2 to 25: 242): 944 frames, where every size at
    # every shape takes 4,505.
    assert frames[64] == 944 and frames[0] > 4 * frames[64], frames
