"""Code2wav's incremental decoder batches across requests by construction (project issue 55, item 3).

On an AVX512 host oneDNN's convolutions (and the vector/scalar split of the snake's sin) gave a
request in a batch other bits than alone, so the start-up check fell back to one request a call.
`decode(rows=True)` now keeps every row apart where an op's kernel could mix them
(`kernels.rows_apart`): every aten op of such a call is one tests/op_audit.py accepts, at every
shape of the block grid, and each request gets its alone bits; the check adopts batching up to its
maximum on any CPU.
"""

from __future__ import annotations

import pytest
import torch

from services.code2wav.blocks import BlockGrid
from services.code2wav.incremental import IncrementalVocoder
from services.code2wav.plan import _Cases, batches_keep_their_bits, shape_classes
from services.code2wav.vocoder import measure_geometry
from services.runtime.chunking import DEFAULT_CHUNKS
from services.runtime.model.checkpoint import Stage, load_stage
from tests.op_audit import OpAudit

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("one_torch_thread")]

BATCH = 5


@pytest.fixture(scope="module")
def vocoder(tiny_checkpoint):
    loaded = load_stage(tiny_checkpoint, Stage.CODE2WAV)
    return IncrementalVocoder(loaded.model, measure_geometry(loaded.model), BlockGrid(DEFAULT_CHUNKS.schedule()))


def test_every_op_of_a_batched_decode_keeps_each_request_s_bits(vocoder, monkeypatch):
    cases = _Cases(vocoder, shape_classes(vocoder), seed=11)
    for index in shape_classes(vocoder):
        batch = cases.first(index, BATCH)
        audit = OpAudit().watching(monkeypatch)
        with audit:
            wav, _ = vocoder.decode([c.block for c in batch], [vocoder.fork(c.state) for c in batch], rows=True)
        audit.assert_clean(f"code2wav, block {index}")
        for i, case in enumerate(batch):
            assert torch.equal(wav[i], case.wav), f"block {index}, request {i}"


def test_the_start_up_check_batches_up_to_its_maximum(vocoder):
    batches, rows, why = batches_keep_their_bits(vocoder, capacity=16)
    assert batches[-1] == 16 and batches[0] == 1, why
