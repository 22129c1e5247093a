"""Every aten op of each stage's exact forwards is one the construction covers (project issue 55).

`tests/op_audit.py` judges each op an engine step dispatches: views and moves, single IEEE
operations, reductions along the last dimension, elementwise functions only over whole pairs of
AVX512 vectors or one row alone, products only as one row's own call; the invariant kernels run in
C, unseen. A step that runs anything else fails here, whichever CPU runs the suite, before a
machine whose kernels differ finds it.
"""

from __future__ import annotations

import pytest
import torch

from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import Stage, load_stage
from services.talker.engine import TalkerEngine
from services.talker.engine_base import TalkerEngineConfig, TextEnd
from services.talker.qwen2_5 import Qwen2_5TalkerEngine, Qwen2_5TalkerJob, ReplyPart
from tests.op_audit import OpAudit, by_construction
from tests.qwen2_5_oracle import load_engine_stages
from tests.talker.test_batch_sizes import job, run

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

BATCH = 33  # past two vectors of AVX512 rows


@pytest.fixture(scope="module")
def talker(tiny_checkpoint):
    return load_stage(tiny_checkpoint, Stage.TALKER)


@pytest.mark.parametrize("gemm", [False, True], ids=["on", "gemm"])
def test_every_op_of_a_talker_decode_batch_keeps_each_row_s_bits(talker, gemm, monkeypatch):
    """The talker's decode steps with the code predictor's frame, BATCH rows (`on`: after the
    prefills, which run alone as generate runs them; `gemm`: prefills included)."""
    config = TalkerEngineConfig(max_batch_size=BATCH, num_slots=BATCH, max_model_len=64, exact_gemm=gemm,
                                max_prefills_per_step=0)
    engine = TalkerEngine(talker.model, talker.config, engine_config=config)
    by_construction(engine)
    audit = OpAudit().watching(monkeypatch)
    run(engine, {f"r{i}": job(talker.config, i) for i in range(BATCH)}, audit=audit, from_step=0 if gemm else 1)
    audit.assert_clean(f"talker, {'gemm' if gemm else 'on'}")


def qwen2_5_job(config, seed: int):
    """A Qwen2.5-Omni talker job of its own length (the thinker's hidden states as seeded stand-ins)."""
    hidden = config.thinker_config.text_config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    work = Qwen2_5TalkerJob(torch.randn(8 + seed % 11, hidden, generator=gen), torch.randn(3, hidden, generator=gen),
                            SamplingConfig(max_new_tokens=4, repetition_penalty=1.05), eos_ids=())
    return work, [ReplyPart(torch.randn(hidden, generator=gen)) for _ in range(2)] + [TextEnd()]


@pytest.mark.slow  # make test's budget: the Qwen3-Omni talker's audit above covers the same kernels
@pytest.mark.parametrize("gemm", [False, True], ids=["on", "gemm"])
def test_every_op_of_a_qwen2_5_talker_decode_batch_keeps_each_row_s_bits(tiny_qwen2_5_checkpoint, gemm, monkeypatch):
    _, model, config = load_engine_stages(tiny_qwen2_5_checkpoint)
    engine = Qwen2_5TalkerEngine(model, config, engine_config=TalkerEngineConfig(
        max_batch_size=BATCH, num_slots=BATCH, max_model_len=64, exact_gemm=gemm, max_prefills_per_step=0))
    by_construction(engine)
    jobs = {f"r{i}": qwen2_5_job(config, i) for i in range(BATCH)}
    audit = OpAudit().watching(monkeypatch)
    together = run(engine, jobs, audit=audit, from_step=0 if gemm else 1)
    audit.assert_clean(f"Qwen2.5-Omni talker, {'gemm' if gemm else 'on'}")
    for rid in ("r0", "r31", "r32"):
        alone = run(engine, {rid: jobs[rid]})[rid]
        assert together[rid][0] == alone[0] and all(torch.equal(a, b) for a, b in zip(together[rid][1], alone[1]))
