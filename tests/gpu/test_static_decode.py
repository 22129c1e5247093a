"""The static-shape steps that CUDA graphs capture (services/runtime/lm/static_decode.py), checked on CPU.

1. Run eagerly on CPU, padded to buckets, the static thinker step, talker step and code-predictor
   frame give the same greedy text ids and codec frames as the engines' row-wise steps, the
   decode steps attending over spans of 40, then 80 positions as their rows grow.
2. Capture safety: at the real Qwen3-Omni layout on the meta device, with transformers told that a
   CUDA stream is capturing (so it skips its own checks, as it does under capture), each step runs
   without a host sync (.item(), .tolist(), nonzero, bool(tensor)): meta tensors have no data, so
   any sync raises. That is what a capture would trip on first; what meta cannot see (host-to-
   device copies of fresh CPU tensors inside the step, kernels without graph support) is left to
   bench/device_check.sh.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from services.runtime.inputs.prompt import PromptBuilder
from services.runtime.lm.kernels import use_rowwise_attention
from services.runtime.lm.kv_slots import SlotKVCache
from services.runtime.model.checkpoint import Stage, _stage_classes, load_stage
from services.runtime.model.full_size import REAL_LAYOUT
from services.runtime.model.settings import GraphSettings
from services.talker.engine import TalkerEngine
from services.talker.engine_base import TalkerEngineConfig
from services.talker.graphs import PredictorGraphs, talker_step
from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig
from services.thinker.graphs import thinker_step
from services.tools.reference import messages_from_args
from services.tools.tiny_checkpoint import build_config, build_tokenizer
from tests.gpu.harness import SLOTS, run_pipeline, static_engines


@pytest.mark.exactness
@pytest.mark.parametrize("device_sampling", [None, True], ids=["host-draws", "draws-in-the-step"])
def test_static_steps_give_the_row_wise_steps_greedy_output(tiny_checkpoint, wav_file, device_sampling):
    # With device sampling the static step draws too (the graph's sampler, penalty history included);
    # the row-wise engines then draw on the device after their forward.
    stages = load_stage(tiny_checkpoint, Stage.THINKER), load_stage(tiny_checkpoint, Stage.TALKER)
    config = stages[0].config
    builder = PromptBuilder(tiny_checkpoint, config)
    requests = {  # different prompt lengths: the rows sit at different cache positions
        "short": (messages_from_args("Hi", None, None, None), 6, 9),
        "long": (messages_from_args("Tell me a long story about a lighthouse keeper.", None, None, None), 9, 7),
        "audio": (messages_from_args("What do you hear?", None, wav_file, None), 4, 10),
    }
    cfg = dict(max_batch_size=SLOTS, num_slots=SLOTS, max_model_len=96, exact_batching=False,
               device_sampling=device_sampling)
    row_wise = (ThinkerEngine(stages[0].model, config, engine_config=ThinkerEngineConfig(**cfg)),
                TalkerEngine(stages[1].model, config, engine_config=TalkerEngineConfig(**cfg)))
    want = run_pipeline(*row_wise, builder, config, requests)
    thinker, talker = static_engines(*stages, device_sampling=device_sampling)
    framed = []  # decode steps whose graph made the whole frame (frame_after), with device sampling
    if talker.graphs.then is not None:
        frame = talker.graphs.graphs.then
        talker.graphs.graphs.then = lambda *args, **kw: framed.append(1) or frame(*args, **kw)
    spans = []  # the span each static step attended over
    for runner in (thinker.graphs.graphs.runner, talker.graphs.graphs.runner):
        runner.fn = lambda *inputs, step=runner.fn: spans.append(inputs[4].shape[0]) or step(*inputs)
    got = run_pipeline(thinker, talker, builder, config, requests)
    for rid in requests:
        assert got[0][rid] == want[0][rid], f"{rid}: text ids"
        assert [f.tolist() for f in got[1][rid]] == [f.tolist() for f in want[1][rid]], f"{rid}: frames"
        assert got[2][rid] == want[2][rid]
    # The static path really ran (padded rows wrote only the scratch slot, never a request's).
    assert thinker.cache.lengths[SLOTS] == 0 and talker.cache.lengths[SLOTS] == 0
    assert thinker.graphs.graphs.runner.stats.eager_calls > 0
    assert set(spans) == {40, 80}  # steps crossed spans (tests/gpu/harness.SPAN) as their rows grew
    assert talker.predictor_graphs.graphs.runner.stats.eager_calls > 0
    assert bool(framed) == bool(device_sampling)


def test_the_decode_graphs_frame_draws_the_residuals_as_the_eager_frame(tiny_checkpoint):
    # One graph a talker step: the decode graph goes on to the code predictor's frame (frame_after),
    # its residual draws from a [8, B] settings input; sampled and greedy rows together draw what the
    # eager frame's picks (TalkerEngine._residual_picks) draw on the same predictor.
    from types import SimpleNamespace

    from services.runtime.lm.device_sampling import Rows
    from services.runtime.lm.sampling import SamplingConfig
    from services.talker.graphs import frame_after

    stage = load_stage(tiny_checkpoint, Stage.TALKER)
    engine = TalkerEngine(stage.model, stage.config, engine_config=TalkerEngineConfig(
        max_batch_size=4, num_slots=4, max_model_len=64, exact_batching=False, device_sampling=True))
    predictor = PredictorGraphs(stage.model, GraphSettings(False, (1, 4)), False, "cpu", torch.float32)
    then = frame_after(predictor, engine.residual_sampler)
    states = [SimpleNamespace(job=SimpleNamespace(sampling=cfg), key=key, frames=frames)
              for cfg, key, frames in ((SamplingConfig(temperature=0.9, seed=1), 11, 3), (SamplingConfig(), 0, 5),
                                       (SamplingConfig(temperature=1.1, seed=2), 22, 0))]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 1, stage.model.config.text_config.hidden_size, generator=g)
    codes0 = torch.randint(0, 100, (3,), generator=g)
    with torch.inference_mode():
        want = predictor.frame(hidden, codes0[:, None], engine._residual_picks(states), False)
        got = then(codes0, hidden, Rows(engine._residual_draws(states), "cpu").params, variant="sampled")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        greedy = predictor.frame(hidden, codes0[:, None], lambda logits: torch.argmax(logits, dim=-1), False)
        assert torch.equal(then(codes0, hidden, variant="greedy")[0], greedy[0])


@pytest.fixture(scope="module")
def meta_stages(tmp_path_factory):
    """Thinker, talker and code2wav at the real layout on the meta device (no memory)."""
    import transformers

    transformers.logging.set_verbosity_error()
    ids = build_tokenizer(tmp_path_factory.mktemp("tok"))
    config = build_config(ids, REAL_LAYOUT)
    config.talker_config.audio_config = config.thinker_config.audio_config
    classes = _stage_classes()
    with torch.device("meta"):
        models = {stage: classes[stage][0]._from_config(getattr(config, classes[stage][1]), dtype=torch.bfloat16).eval()
                  for stage in Stage}
    use_rowwise_attention(models[Stage.THINKER].config.text_config)
    use_rowwise_attention(models[Stage.TALKER].config.text_config, models[Stage.TALKER].code_predictor.config)
    return models


def capturing():
    """transformers believes a CUDA stream is capturing (it then skips its host-side checks)."""
    import transformers.utils.import_utils as iu

    return mock.patch.object(iu, "is_cuda_stream_capturing", lambda: True)


def meta(*shape, dtype=torch.long):
    return torch.zeros(shape, dtype=dtype, device="meta")


def test_meta_proxy_catches_a_host_sync():
    with pytest.raises(Exception, match="meta"):
        meta(2).sum().item()


@pytest.mark.parametrize("batch", [1, 8])
def test_thinker_and_talker_steps_have_no_host_sync_at_full_size(meta_stages, batch):
    thinker, talker = meta_stages[Stage.THINKER], meta_stages[Stage.TALKER]
    text_config = thinker.config.text_config  # lm/kernels.py wraps the configured experts row-wise
    assert getattr(text_config, "_omni_base_experts", text_config._experts_implementation) == "grouped_mm"
    with torch.inference_mode(), capturing():
        cache = SlotKVCache.for_config(thinker.config.text_config, 3, 32, torch.bfloat16, "meta")
        logits = thinker_step(thinker, cache)(meta(batch, 1), meta(4, batch, 1), meta(batch), meta(batch), meta(32))
        assert logits.shape == (batch, 152064)
        cache = SlotKVCache.for_config(talker.config.text_config, 3, 32, torch.bfloat16, "meta")
        logits, hidden = talker_step(talker, cache)(meta(batch, 1, 1024, dtype=torch.bfloat16), meta(4, batch, 1),
                                                    meta(batch), meta(batch), meta(32))
        assert logits.shape == (batch, 3072) and hidden.shape == (batch, 1, 1024)


def test_code_predictor_frame_has_no_host_sync_at_full_size(meta_stages):
    talker = meta_stages[Stage.TALKER]
    graphs = PredictorGraphs(talker, GraphSettings(False, (1, 8)), False, "meta", torch.bfloat16)
    with torch.inference_mode(), capturing():
        codes, embeds = graphs._frame(meta(8, 1, 1024, dtype=torch.bfloat16), meta(8, 1))
    assert codes.shape == (8, 16) and embeds.shape == (8, 1, 1024)


def test_code2wav_window_has_no_host_sync_at_full_size(meta_stages):
    from services.code2wav.graphs import Code2WavGraphs

    graphs = Code2WavGraphs(meta_stages[Stage.CODE2WAV], GraphSettings(False, (1, 8)))
    with torch.inference_mode(), capturing():
        wav = graphs._forward(meta(8, 16, 29))
    assert wav.shape == (8, 29 * 1920 - 555)
