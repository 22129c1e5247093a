"""CUDA graphs on a real GPU, on the tiny checkpoint (skipped without CUDA; bench/device_check.sh
runs this file first, in well under a minute, before the full-size benchmark).

Replaying a captured graph runs the kernels the capture recorded, so the engines with graphs on
must give exactly what the same static steps give eagerly; code2wav's replayed windows must equal
its eager forward.
"""

from __future__ import annotations

import pytest
import torch

from services.code2wav.graphs import Code2WavGraphs
from services.code2wav.vocoder import forward_batch
from services.runtime.inputs.prompt import PromptBuilder
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.settings import GraphSettings
from services.talker.engine import TalkerEngine
from services.talker.engine_base import TalkerEngineConfig
from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig
from services.tools.reference import messages_from_args
from tests.gpu.harness import run_pipeline, static_engines

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BUCKETS = (1, 2, 4, 8)


def cuda_stages(folder, dtype):
    return {s: load_stage(folder, s, device="cuda", dtype=dtype) for s in Stage}


@pytest.mark.exactness
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engines_with_graphs_equal_the_same_static_steps_run_eagerly(tiny_checkpoint, dtype):
    stages = cuda_stages(tiny_checkpoint, dtype)
    config = stages[Stage.THINKER].config
    builder = PromptBuilder(tiny_checkpoint, config)
    requests = {
        "short": (messages_from_args("Hi", None, None, None), 6, 9),
        "long": (messages_from_args("Tell me a long story about a lighthouse keeper.", None, None, None), 9, 7),
        "third": (messages_from_args("What is the weather like?", None, None, None), 4, 10),
    }
    settings = GraphSettings(True, BUCKETS)
    cfg = dict(max_batch_size=4, num_slots=4, max_model_len=96, exact_batching=False, graphs=settings)
    thinker = ThinkerEngine(stages[Stage.THINKER].model, config, "cuda", ThinkerEngineConfig(**cfg))
    talker = TalkerEngine(stages[Stage.TALKER].model, config, "cuda", TalkerEngineConfig(**cfg))
    for runner in (thinker.graphs.runner, talker.graphs.runner, talker.predictor_graphs.runner):
        assert runner.stats.failed is None, runner.stats.failed
        assert runner.stats.captures == len(BUCKETS)
    got = run_pipeline(thinker, talker, builder, config, requests)
    assert thinker.graphs.runner.stats.replays > 0 and talker.predictor_graphs.runner.stats.replays > 0
    eager_thinker, eager_talker = static_engines(stages[Stage.THINKER], stages[Stage.TALKER], device="cuda")
    want = run_pipeline(eager_thinker, eager_talker, builder, config, requests)
    for rid in requests:
        assert got[0][rid] == want[0][rid], f"{rid}: text ids"
        assert [f.tolist() for f in got[1][rid]] == [f.tolist() for f in want[1][rid]], f"{rid}: frames"


@pytest.fixture
def full_float32():
    """cuDNN convolutions run float32 as TF32 by default, and it picks its algorithm by batch size:
    a window replayed in a padded bucket and the same window in an eager batch of another size then
    differ by TF32's rounding (seen: 9e-3 on an H200). Without TF32 only float32's rounding remains."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.exactness
def test_code2wav_replayed_windows_equal_the_eager_forward(tiny_checkpoint, full_float32):
    model = load_stage(tiny_checkpoint, Stage.CODE2WAV, device="cuda").model
    graphs = Code2WavGraphs(model, GraphSettings(True, BUCKETS))
    graphs.capture((4, 29), 16)
    assert graphs.runner.stats.failed is None and graphs.runner.stats.captures == 2 * len(BUCKETS)
    gen = torch.Generator().manual_seed(0)
    for batch, n in ((1, 4), (3, 29), (5, 29), (2, 11)):  # 11: captured on first use
        windows = torch.randint(0, 64, (batch, n, 16), generator=gen)
        torch.testing.assert_close(graphs.decode(windows), forward_batch(model, windows), rtol=1e-5, atol=1e-5)
    assert graphs.runner.has((11, 2))
