"""The LM decode steps' counts at the full-size layout on the meta device (tests/gpu/step_counts.py) stay
at or below today's: graph nodes a replay launches, device ops outside the graphs per batch size,
host syncs a step, and the bytes a replay moves at the default --max-model-len against 256. Counts
are deterministic, so these are upper bounds, not timings; docs/gpu.md ("LM steps, counted") has the
table. A change that lowers a count lowers its bound here; one that raises it says why."""

from __future__ import annotations

import pytest

from services.runtime.model.checkpoint import Stage
from tests.gpu.step_counts import BATCHES, meta_models, stage_counts

pytestmark = pytest.mark.slow  # about 30 s on 2 cores

# stage -> (graph nodes, eager device ops at any batch), graphs on, --max-model-len 4096. Every step
# syncs with the host once (its one copy back), whatever the batch.
BOUNDS = {
    Stage.THINKER: (2341, 18),
    Stage.TALKER: (2672, 21),
}
SYNCS = 1
# stage -> device ops of an eager step (graphs off) at batch 64: attention batched, not one SDPA a row.
EAGER_AT_64 = {Stage.THINKER: 2342, Stage.TALKER: 4666}


@pytest.fixture(scope="module")
def models():
    return meta_models()


@pytest.mark.parametrize("stage", [Stage.THINKER, Stage.TALKER])
def test_decode_step_counts_stay_within_todays(models, stage):
    config, stage_models = models
    nodes, eager = BOUNDS[stage]
    for batch in BATCHES:
        counts = stage_counts(config, stage_models, stage, batch)
        assert counts.graph_nodes <= nodes, f"{stage} B={batch}: {counts.row()}"
        assert counts.syncs <= SYNCS, f"{stage} B={batch}: {counts.row()}"
        assert counts.eager_ops <= eager, f"{stage} B={batch}: {counts.row()}"  # not growing with the batch


@pytest.mark.parametrize("stage", [Stage.THINKER, Stage.TALKER])
def test_the_default_max_model_len_costs_a_replay_what_256_does(models, stage):
    """Rows of 100 tokens attend over the 256-position span whatever --max-model-len is (at most 10 %
    more bytes allowed; today the same), and the eager batched step attends in one call a layer."""
    config, stage_models = models
    long, short = (stage_counts(config, stage_models, stage, 64, max_model_len) for max_model_len in (4096, 256))
    assert long.graph_nodes == short.graph_nodes
    assert long.graph_bytes <= 1.10 * short.graph_bytes, (long.row(), short.row())
    eager = stage_counts(config, stage_models, stage, 64, graphs=False)
    assert eager.eager_ops <= EAGER_AT_64[stage], eager.row()
