"""A talker decode batch of any size gives every row the bits it gets alone (project issue 55).

On an AVX512 CPU ATen runs an elementwise op's whole pairs of 16-float vectors with Sleef's exp and
the rest of the run with libm's, so an op over [B, 1] (the shared-expert gate's sigmoid) gave row
32 of a 33-row batch other bits than alone; under AVX2 the step is 16 rows. No test ran a batch past
16 rows, so none saw it. Here the engine decodes batches at and past both steps (1 to 64 rows), in
per-row mode (`on`: each row against its own alone run) and through the invariant kernels (`gemm`),
and every request's codes and every step's logits must equal its alone run's, bit for bit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.runtime.model.checkpoint import Stage, load_stage
from services.talker.engine import TalkerEngine
from services.talker.engine_base import Frame, TalkerDone, TalkerEngineConfig
from tests.talker.pipeline import seeded_job

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

SIZES = (1, 15, 16, 17, 31, 32, 33, 48, 64)  # at, below and past 1 and 2 vectors of AVX2 and AVX512 rows
FRAMES = 3


@pytest.fixture(scope="module")
def talker(tiny_checkpoint):
    return load_stage(tiny_checkpoint, Stage.TALKER)


def job(config, seed: int) -> tuple:
    """A talker job of its own length (5 to 15 user ids) and its text rows."""
    return seeded_job(config, 5 + seed % 11, seed, FRAMES + 1, 2)


def run(engine: TalkerEngine, jobs: dict, audit: TorchDispatchMode | None = None, from_step: int = 0) -> dict:
    """Every job at once through `engine` -> request_id -> (frames, each step's logits); every
    decode step after the prefills runs all of them together (asserted). `audit`: a dispatch mode
    around every step from `from_step` on."""
    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in jobs}
    batches: list[int] = []  # rows of each forward
    frames: dict[str, list[list[int]]] = {rid: [] for rid in jobs}
    after_forward = engine._after_forward

    def recording(request_ids, states, step_logits, *rest, **more):
        batches.append(len(request_ids))
        for rid, row in zip(request_ids, step_logits):
            logits[rid].append(row.detach().clone())
        return after_forward(request_ids, states, step_logits, *rest, **more)

    engine._after_forward = recording
    try:
        for rid, (talker_job, inputs) in jobs.items():
            engine.add(rid, talker_job)
            for payload in inputs:
                engine.add_input(rid, payload)
        done, step = set(), 0
        while engine.has_work():
            with audit if audit is not None and step >= from_step else contextlib.nullcontext():
                events = engine.step()
            step += 1
            for rid, event in events:
                if isinstance(event, Frame):
                    frames[rid].append(event.codes.tolist())
                elif isinstance(event, TalkerDone):
                    done.add(rid)
        assert done == set(jobs) and engine.running == 0
        assert batches.count(len(jobs)) >= FRAMES, f"decode batches {batches}: never {len(jobs)} rows"
    finally:
        engine._after_forward = after_forward
    return {rid: (frames[rid], logits[rid]) for rid in jobs}


@pytest.mark.parametrize("gemm", [False, True], ids=["on", "gemm"])
def test_a_decode_batch_of_any_size_gives_each_row_its_alone_bits(talker, gemm):
    size = max(SIZES)
    config = TalkerEngineConfig(max_batch_size=size, num_slots=size, max_model_len=64, exact_gemm=gemm,
                                max_prefills_per_step=0)  # all waiting prompts in one step
    engine = TalkerEngine(talker.model, talker.config, engine_config=config)
    jobs = {f"r{i}": job(talker.config, i) for i in range(size)}
    alone = {rid: run(engine, {rid: work})[rid] for rid, work in jobs.items()}
    for batch in SIZES[1:]:
        together = run(engine, dict(list(jobs.items())[:batch]))
        for rid, (frames, logits) in together.items():
            want_frames, want_logits = alone[rid]
            assert frames == want_frames and len(frames) == FRAMES, f"batch {batch}, {rid}: frames"
            assert len(logits) == len(want_logits), f"batch {batch}, {rid}: steps"
            for step, (got, want) in enumerate(zip(logits, want_logits)):
                assert torch.equal(got, want), f"batch {batch}, {rid}: step {step}'s logits"
