"""The lean code-predictor loop (services/talker/code_predictor.py) against transformers' own
predictor forward, frame by frame, bit for bit (the engine tests compare whole requests with
`generate`; this pins the loop itself, at several batch sizes and in both batching modes)."""

from __future__ import annotations

import pytest
import torch

from services.runtime.lm.invariance import check_exact_kernels, linear_weights
from services.runtime.lm.kernels import ExactKernels, use_rowwise_attention, using_kernels
from services.runtime.lm.kv_slots import SlotKVCache
from services.runtime.model.checkpoint import Stage, load_stage
from services.talker.code_predictor import CodePredictor, predict_frame

pytestmark = pytest.mark.exactness


def probed(talker, capacity: int) -> ExactKernels:
    """The paths a talker engine's start-up probe picks on this machine for the predictor."""
    lean = CodePredictor(talker, capacity, "cpu", torch.float32)
    return check_exact_kernels(gemm=False, capacity=capacity, linear_weights=linear_weights(talker.code_predictor),
                               linear_tokens=(1, 2), attention=lean.attention_shapes()).kernels


@pytest.fixture(scope="module")
def talker(tiny_checkpoint):
    model = load_stage(tiny_checkpoint, Stage.TALKER).model
    use_rowwise_attention(model.config.text_config, model.code_predictor.config)
    return model


@pytest.mark.parametrize("batch,exact,paths", [(1, True, "rows"), (3, True, "rows"), (8, True, "rows"),
                                               (3, True, "probed"), (8, True, "probed"),
                                               (1, False, "rows"), (3, False, "rows"), (8, False, "rows")],
                         ids=["1-exact-rows", "3-exact-rows", "8-exact-rows", "3-exact-probed", "8-exact-probed",
                              "1-plain", "3-plain", "8-plain"])
def test_lean_loop_equals_the_transformers_forward(talker, batch, exact, paths):
    hidden = talker.config.text_config.hidden_size
    kernels = probed(talker, 8) if paths == "probed" else ExactKernels()
    lean = CodePredictor(talker, 8, "cpu", torch.float32)
    cache = SlotKVCache.for_config(talker.code_predictor.config, 8, lean.num_groups + 1, torch.float32, "cpu")
    g = torch.Generator().manual_seed(batch)
    with torch.inference_mode():
        for _ in range(3):  # the buffers are reused frame after frame
            past = torch.randn(batch, 1, hidden, generator=g)
            codes0 = torch.randint(0, talker.code_predictor.config.vocab_size, (batch, 1), generator=g)
            for row in range(batch):
                cache.reset(row)
            with using_kernels(kernels):
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


def test_batched_greedy_code_selection_equals_select_token_per_row():
    # engine_base.greedy_codes (both talkers'): the repetition penalty, the suppressed range and argmax
    # over a batch, against select_token row by row (ties, negative scores, penalties 1 and 1.05).
    from types import SimpleNamespace

    from services.runtime.lm.sampling import SamplingConfig, select_token
    from services.talker.engine import _State
    from services.talker.engine_base import greedy_codes

    g = torch.Generator().manual_seed(0)
    vocab = 96
    suppress = torch.zeros(vocab, dtype=torch.bool)
    suppress[64:] = True
    suppress[66] = False
    states, logits = [], torch.randn(6, vocab, generator=g)
    logits[1, 3] = logits[1, 7] = logits[1].max() + 1  # a tie: the first index wins
    for row in range(6):
        codes = torch.randint(0, 70, (row * 3,), generator=g).tolist()
        sampling = SamplingConfig(repetition_penalty=1.0 if row == 2 else 1.05)
        state = _State(job=SimpleNamespace(sampling=sampling), codes=codes)
        if codes:
            state.seen = torch.zeros(vocab, dtype=torch.bool)
            state.seen[codes] = True
        logits[row, codes[:2]] = -logits[row, codes[:2]].abs()  # some penalised scores negative
        states.append(state)
    picked = greedy_codes(states, logits, suppress)
    assert picked == {row: select_token(logits[row], s.job.sampling, s.codes, None, suppress)
                      for row, s in enumerate(states)}


@pytest.mark.parametrize("paths", ["probed", "gemm"])
def test_lean_loop_rows_keep_their_logits_bits_through_column_tiles(wide_checkpoint, paths):
    # On the wide preset the predictor's MLP weights are 3 MB: exact batching multiplies them a
    # column tile at a time (batching.rowwise_matmul). Every step's logits of a batched row must
    # equal, bit for bit, the row's logits alone (batch 1: plain F.linear, the reference's kernel).
    from services.runtime.lm import kernels as batching

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiles are used on one thread only
    try:
        talker = load_stage(wide_checkpoint, Stage.TALKER).model
        use_rowwise_attention(talker.config.text_config, talker.code_predictor.config)
        assert batching.tile_columns(talker.code_predictor.model.layers[0].mlp.gate_proj.weight, tokens=1)
        lean = CodePredictor(talker, 5, "cpu", torch.float32)
        kernels = probed(talker, 5) if paths == "probed" else batching.GEMM_KERNELS
        g = torch.Generator().manual_seed(0)
        past = torch.randn(5, 1, talker.config.text_config.hidden_size, generator=g)
        codes0 = torch.randint(0, talker.code_predictor.config.vocab_size, (5, 1), generator=g)

        def run(rows):
            seen = []

            def pick(logits):
                seen.append(logits.clone())
                return torch.argmax(logits, dim=-1)
            with torch.inference_mode(), using_kernels(kernels):
                codes, _ = lean(past[rows], codes0[rows], pick, True)
            return codes, seen

        codes, together = run(slice(0, 5))
        for row in range(5):
            alone_codes, alone = run(slice(row, row + 1))
            assert torch.equal(codes[row:row + 1], alone_codes)
            assert all(torch.equal(t[row:row + 1], a) for t, a in zip(together, alone, strict=True))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("batch", [1, 5])
def test_the_fused_frame_picks_the_transformers_forwards_codes(tiny_checkpoint, batch):
    # The CUDA graph's frame (exact batching off): q/k/v and gate/up as single GEMMs over the modules'
    # own weights, one op a norm, rotate-half as a roll. Not exact mode's bits, the same greedy codes.
    model = load_stage(tiny_checkpoint, Stage.TALKER).model  # its own: fusing makes the weights views
    use_rowwise_attention(model.config.text_config, model.code_predictor.config)
    hidden = model.config.text_config.hidden_size
    reference = CodePredictor(model, 8, "cpu", torch.float32)
    fused = CodePredictor(model, 8, "cpu", torch.float32, batched_attention=True, fused=True)
    g = torch.Generator().manual_seed(batch)
    pick = lambda logits: torch.argmax(logits, dim=-1)  # noqa: E731
    with torch.inference_mode():
        for _ in range(3):
            past = torch.randn(batch, 1, hidden, generator=g)
            codes0 = torch.randint(0, model.code_predictor.config.vocab_size, (batch, 1), generator=g)
            want, got = reference(past, codes0, pick, False), fused(past, codes0, pick, False)
            assert torch.equal(got[0], want[0])
            torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    q = model.code_predictor.model.layers[0].self_attn.q_proj.weight
    assert q.untyped_storage().data_ptr() == fused.qkv[0].untyped_storage().data_ptr()  # stored once
