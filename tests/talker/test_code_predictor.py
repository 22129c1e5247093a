"""The lean code-predictor loop (services/talker/code_predictor.py) against transformers' own
predictor forward, frame by frame, bit for bit (the engine tests compare whole requests with
`generate`; this pins the loop itself, at several batch sizes and in both batching modes)."""

from __future__ import annotations

import pytest
import torch

from services.runtime.batching import SlotKVCache, use_rowwise_attention
from services.runtime.checkpoint import Stage, load_stage
from services.talker.code_predictor import CodePredictor, predict_frame


@pytest.fixture(scope="module")
def talker(tiny_checkpoint):
    model = load_stage(tiny_checkpoint, Stage.TALKER).model
    use_rowwise_attention(model.config.text_config, model.code_predictor.config)
    return model


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "plain"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_lean_loop_equals_the_transformers_forward(talker, batch, exact):
    hidden = talker.config.text_config.hidden_size
    lean = CodePredictor(talker, 8, "cpu", torch.float32)
    cache = SlotKVCache.for_config(talker.code_predictor.config, 8, lean.num_groups + 1, torch.float32, "cpu")
    g = torch.Generator().manual_seed(batch)
    with torch.inference_mode():
        for _ in range(3):  # the buffers are reused frame after frame
            past = torch.randn(batch, 1, hidden, generator=g)
            codes0 = torch.randint(0, talker.code_predictor.config.vocab_size, (batch, 1), generator=g)
            for row in range(batch):
                cache.reset(row)
            want = predict_frame(talker, past, codes0, cache.batch(list(range(batch))),
                                 lambda logits: torch.argmax(logits, dim=-1), exact)
            got = lean(past, codes0, lambda logits: torch.argmax(logits, dim=-1), exact)
            assert torch.equal(got[0], want[0])
            assert torch.equal(got[1], want[1])


def test_lean_loop_refuses_more_rows_than_its_buffers(talker):
    lean = CodePredictor(talker, 2, "cpu", torch.float32)
    with pytest.raises(ValueError, match="exceed"):
        lean(torch.zeros(3, 1, talker.config.text_config.hidden_size), torch.zeros(3, 1, dtype=torch.long),
             lambda logits: torch.argmax(logits, dim=-1), True)
