"""Thinker + talker engines on the wide preset's checkpoint against transformers' generate.

The tiny checkpoint's weights are kilobytes; here the code predictor's MLP, the talker's codec
head and the thinker's expert weights are 2-3 MB, so exact batching takes the column-tiled
products of services/runtime/lm/kernels.py (`rowwise_matmul`) on them: the whole batched path at
other widths, whose greedy text ids and codec frames must equal the reference for every request.
Greedy ids are blunt (random weights leave wide margins); the bits of each tiled row are pinned
by tests/runtime/lm/test_kernels.py and tests/talker/test_code_predictor.py.
"""

from __future__ import annotations

import pytest
import torch

from services.runtime.inputs.prompt import PromptBuilder
from services.runtime.lm import kernels as batching
from services.runtime.model.checkpoint import Stage, load_stage
from services.tools.reference import messages_from_args
from tests.talker.pipeline import assert_clean
from tests.talker.test_engine import Case, Pipeline, assert_equals_reference, reference_results

pytestmark = [pytest.mark.exactness, pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
              pytest.mark.usefixtures("one_thread")]

CASES = [
    Case("wide-ethan", "Hello there!", "ethan", False, False, 6, 9, 0),
    Case("wide-chelsie", "Tell me about the sea.", "chelsie", False, False, 9, 8, 0),
    Case("wide-aiden", "Hi", "aiden", False, False, 5, 10, 2),
]


@pytest.fixture(scope="module")
def one_thread():
    # Column tiles are taken on one torch thread only (the stages' default on small machines).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def stages(wide_checkpoint, one_thread):
    return load_stage(wide_checkpoint, Stage.THINKER), load_stage(wide_checkpoint, Stage.TALKER)


def test_batched_requests_equal_the_reference_through_column_tiles(wide_checkpoint, stages):
    talker = stages[1].model
    tiled = [w for w in (talker.code_predictor.model.layers[0].mlp.gate_proj.weight, talker.codec_head.weight)
             if batching.tile_columns(w, tokens=1) is not None]
    assert len(tiled) == 2  # both go through the tiled path here
    messages = {c.request_id: messages_from_args(c.prompt, None, None, None) for c in CASES}
    expected = reference_results(wide_checkpoint, CASES, messages)
    pipe = Pipeline(stages, PromptBuilder(wide_checkpoint, stages[0].config)).run(CASES, messages)
    assert_equals_reference(pipe, expected, [c.request_id for c in CASES])
    assert_clean(pipe)


@pytest.mark.slow  # 7 s; the column-tile test above keeps the wide layout in make test: make test-slow (CI)
def test_batched_requests_through_the_invariant_gemm_equal_generate_through_it(wide_checkpoint, stages):
    # --exact-batching gemm at width, where its weight reuse matters: against generate run through
    # the same op (its bits are not MKL's); the default mode is compared with plain generate above.
    messages = {c.request_id: messages_from_args(c.prompt, None, None, None) for c in CASES}
    expected = reference_results(wide_checkpoint, CASES, messages, gemm=True)
    pipe = Pipeline(stages, PromptBuilder(wide_checkpoint, stages[0].config), gemm=True).run(CASES, messages)
    assert pipe.talker.exact_report.kernels.experts is batching.KernelPath.GEMM
    assert_equals_reference(pipe, expected, [c.request_id for c in CASES])
    assert_clean(pipe)
