"""Qwen3-Omni's streamed audio is a function of the frames alone, never of how the talker cut them
or of what else code2wav decodes (services/code2wav/blocks.py, plan.py): bit for bit, with both
decoders, and exact mode's check keeps the plan exact by construction where a machine's kernels
would break that."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from services.code2wav.blocks import BlockGrid, BlockStream, StreamDecoder
from services.code2wav.config import Code2WavConfig, Decoder
from services.code2wav.engine import Audio, Code2WavEngine, CodecChunk, CodecEnd
from services.code2wav.incremental import IncrementalVocoder
from services.code2wav.plan import BlockPlan, plan_blocks
from services.code2wav.qwen3_adapter import Qwen3Code2WavAdapter
from services.code2wav.vocoder import VocoderGeometry, measure_geometry
from services.code2wav.window import WindowVocoder
from services.runtime.chunking import DEFAULT_CHUNKS
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from tests.audio_checks import check_streamed_audio

FRAMES = 61
GEOMETRY = VocoderGeometry(samples_per_frame=1920, lookahead_samples=555, sample_rate=24000)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_stage(tiny_checkpoint, Stage.CODE2WAV)


@pytest.fixture(scope="module")
def frames() -> torch.Tensor:
    return torch.randint(0, 64, (FRAMES, 16), generator=torch.Generator().manual_seed(5))


GRID = BlockGrid(DEFAULT_CHUNKS.schedule())  # 4, 8, 16, 25, 25, ...


def vocoder_for(loaded, decoder: Decoder, grid: BlockGrid = GRID):
    geometry = measure_geometry(loaded.model)
    if decoder is Decoder.WINDOW:
        return WindowVocoder(loaded.model, geometry, grid, left_context=25)
    return IncrementalVocoder(loaded.model, geometry, grid)


def cut_plans() -> dict[str, list[int]]:
    random_cuts = torch.randint(1, 9, (FRAMES,), generator=torch.Generator().manual_seed(7)).tolist()
    cuts, total = [], 0
    for n in random_cuts:
        cuts.append(min(n, FRAMES - total))
        total += cuts[-1]
        if total == FRAMES:
            break
    return {"talker": DEFAULT_CHUNKS.sizes(FRAMES), "one by one": [1] * FRAMES, "threes": [3] * 20 + [1],
            "random": cuts, "whole": [FRAMES], "after a pause": [4, 8, 2, 1, 1, 9, 5, 31]}


def streamed(vocoder, frames: torch.Tensor, cuts: list[int]) -> np.ndarray:
    decoder, out, start = StreamDecoder(vocoder), [], 0
    for n in cuts:
        out.append(decoder.push(frames[start:start + n]))
        start += n
    return np.concatenate(out + [decoder.finish()])


@pytest.mark.exactness
@pytest.mark.parametrize("decoder", list(Decoder))
def test_the_audio_has_the_same_bits_however_the_frames_were_cut(loaded, frames, decoder):
    vocoder = vocoder_for(loaded, decoder)
    audio = {name: streamed(vocoder, frames, cuts) for name, cuts in cut_plans().items()}
    first = audio["talker"]
    for name, wav in audio.items():
        assert np.array_equal(wav, first), name
    check_streamed_audio(loaded.model, frames, first, margin_db=2.0 if decoder is Decoder.WINDOW else 1.0)


def run_engine(engine, feeds: dict[str, tuple[torch.Tensor, list[int]]]) -> dict[str, np.ndarray]:
    """Each request's frames fed in its cuts, the requests' chunks interleaved, stepping between
    every round of chunks: request_id -> its audio."""
    for request_id in feeds:
        engine.add(request_id)
    audio: dict[str, list[np.ndarray]] = {r: [] for r in feeds}
    starts = {r: 0 for r in feeds}
    rounds = max(len(cuts) for _, cuts in feeds.values())
    for k in range(rounds + 1):
        for request_id, (codes, cuts) in feeds.items():
            if k < len(cuts):
                engine.add_input(request_id, CodecChunk(codes[starts[request_id]:starts[request_id] + cuts[k]]))
                starts[request_id] += cuts[k]
            elif k == len(cuts):
                engine.add_input(request_id, CodecEnd())
        for request_id, event in engine.step():
            if isinstance(event, Audio):
                audio[request_id].append(event.samples)
    while engine.has_work():
        for request_id, event in engine.step():
            if isinstance(event, Audio):
                audio[request_id].append(event.samples)
    assert engine.running == 0
    return {r: np.concatenate(parts) for r, parts in audio.items()}


def engine_for(loaded, decoder: Decoder) -> Code2WavEngine:
    config = Code2WavConfig(serving=ServingConfig(), model=ModelConfig(checkpoint="unused"), decoder=decoder)
    return Qwen3Code2WavAdapter(loaded, config).build_engine()


@pytest.mark.exactness
@pytest.mark.parametrize("decoder", list(Decoder))
def test_a_request_gets_its_alone_bits_whatever_else_the_engine_decodes_beside_it(loaded, frames, decoder):
    engine = engine_for(loaded, decoder)
    assert engine.plan.batches[-1] > 1  # this CPU batches (convolutions per row or not): the test batches too
    alone = run_engine(engine, {"a": (frames, [FRAMES])})["a"]
    others = {f"o{i}": (torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(i)), [4, 8, n - 12])
              for i, n in enumerate((40, 33, 17, 61, 25, 50))}
    crowded = run_engine(engine, {"a": (frames, cut_plans()["after a pause"]), **others})
    assert np.array_equal(crowded["a"], alone)
    for request_id, (codes, _) in others.items():
        assert np.array_equal(crowded[request_id], run_engine(engine, {request_id: (codes, [codes.shape[0]])})[request_id])


class LeakyOpenBlocks(IncrementalVocoder):
    """A machine whose kernels let an open block's zero frames change the frames it has."""

    def decode(self, blocks, states, rows=False):
        wav, after = super().decode(blocks, states, rows)
        return wav + 1e-6 * sum(not b.full for b in blocks), after


class RowsDependOnTheBatch(IncrementalVocoder):
    """A machine where batching changes every row's bits (`always`), or only with batched convolutions."""

    always = False

    def decode(self, blocks, states, rows=False):
        wav, after = super().decode(blocks, states, rows)
        return (wav + 1e-6 if len(blocks) > 1 and (self.always or not rows) else wav), after


def engine_with(vocoder, plan: BlockPlan, loaded) -> Code2WavEngine:
    return Code2WavEngine(vocoder, plan, loaded.config)


@pytest.mark.exactness
def test_where_an_open_block_changes_bits_open_blocks_wait_and_the_audio_does_not_follow_the_cuts(
        loaded, frames, caplog):
    geometry = measure_geometry(loaded.model)
    with caplog.at_level(logging.INFO, logger="services.code2wav.plan"):
        vocoder, plan, _ = plan_blocks(lambda grid: LeakyOpenBlocks(loaded.model, geometry, grid), GRID, 16, exact=True)
    assert plan.grid == vocoder.grid == GRID and not plan.open_blocks
    assert "an open block decoded once whole (an open block of the grid 4,8,16,25 changed the bits" in \
        plan.reasons["block"]
    assert plan.paths()["open_block"] == "when_whole"
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # logged once
    engine = engine_with(vocoder, plan, loaded)
    audio = {name: run_engine(engine, {"a": (frames, cuts)})["a"] for name, cuts in cut_plans().items()}
    assert all(np.array_equal(wav, audio["whole"]) for wav in audio.values())
    # The leak is real: the same vocoder decoding open blocks when due gives cut-dependent audio.
    leaky = engine_with(vocoder, dataclasses.replace(plan, open_blocks=True), loaded)
    assert not np.array_equal(run_engine(leaky, {"a": (frames, cut_plans()["one by one"])})["a"], audio["whole"])


@pytest.mark.exactness
@pytest.mark.parametrize("always", [False, True])
def test_batches_that_change_a_row_s_bits_are_never_used(loaded, always):
    geometry = measure_geometry(loaded.model)
    # A vocoder whose rows path is not exact by construction (both decoders' are: rows_apart), so the
    # check runs it too.
    leaky = type("Leaky", (RowsDependOnTheBatch,), {"always": always, "rows_alone": False})
    _, plan, _ = plan_blocks(lambda grid: leaky(loaded.model, geometry, grid), GRID, 16, exact=True)
    if always:
        assert plan.batches == (1,) and plan.paths() == {"conv": "batched", "vocoder": "alone",
                                                         "open_block": "when_due"}
    else:
        assert plan.rows and plan.batches[-1] == 16 and plan.paths()["conv"] == "rows"


def test_without_exact_mode_nothing_is_checked(loaded):
    geometry = measure_geometry(loaded.model)
    _, plan, check = plan_blocks(lambda grid: LeakyOpenBlocks(loaded.model, geometry, grid), GRID, 8, exact=False)
    assert (plan.grid, plan.batches, plan.rows, plan.open_blocks, check) == (GRID, tuple(range(1, 9)), False, True,
                                                                              None)


def test_a_block_stream_pads_the_open_block_and_emits_only_final_samples():
    U, L = GEOMETRY.samples_per_frame, GEOMETRY.lookahead_samples
    stream = BlockStream(BlockGrid((4,)), GEOMETRY)
    stream.push(torch.arange(3 * 2).view(3, 2) + 1)
    block = stream.next_block()
    assert (block.index, block.real, block.full) == (0, 3, False)
    assert block.frames[3].tolist() == [0, 0]  # a zero frame where frame 3 has not come
    out = stream.accept(block, torch.arange(4 * U - L, dtype=torch.float32), 0)
    assert out.size == 3 * U - L and not stream.ready and not stream.whole  # the rest waits for frame 3
    stream.push(torch.ones(2, 2, dtype=torch.long))
    block = stream.next_block()
    assert (block.index, block.real) == (0, 4)  # the same block again, now whole
    out = stream.accept(block, torch.arange(4 * U - L, dtype=torch.float32), 0)
    assert out[0] == 3 * U - L and out.size == U  # only what was not emitted
    block = stream.next_block()
    assert (block.index, block.real, stream.blocks) == (1, 1, 1)
    assert stream.ready and not stream.whole
    stream.end()
    assert stream.whole  # an ended stream's open block is as whole as it gets
    out = stream.accept(block, torch.zeros(4 * U), 4 * U - L)
    assert out.size == U and stream.samples_emitted == 5 * U - L and stream.done


def test_the_grid_follows_the_talker_s_schedule_then_repeats_its_last_size():
    assert [(GRID.first_frame(i), GRID.size(i)) for i in range(6)] == [(0, 4), (4, 8), (12, 16), (28, 25), (53, 25), (78, 25)]
    with pytest.raises(ValueError):
        BlockGrid((4, 0))


def test_a_call_s_batch_stays_within_its_frames():
    plan = BlockPlan(GRID, (1, 2, 3, 4, 8, 16), max_frames=64)
    assert [plan.batch_for(16, n) for n in (4, 8, 16, 25)] == [16, 8, 4, 2]
    assert plan.batch_for(3, 4) == 3 and plan.batch_for(7, 4) == 4 and plan.batch_for(16, 100) == 1
    assert BlockPlan(GRID, (1, 2, 3, 4, 8, 16)).batch_for(16, 25) == 16  # no bound
