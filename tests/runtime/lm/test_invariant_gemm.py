"""omni's batch-invariant GEMM (services/runtime/lm/invariant_gemm.py, invariant_gemm.c) and the GEMM
path of exact mode: every row the same bits whatever the batch, by construction, on any ISA."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from services.runtime.lm import invariant_gemm
from services.runtime.lm import kernels as batching
from services.runtime.lm.kernels import GEMM_KERNELS, batch_invariant, using_kernels
from tests.runtime.lm.test_kernels import experts_module

pytestmark = pytest.mark.exactness  # make setup builds the library: no compiler is a failure, not a skip


def gemm(x, w, b=None, isa=None):
    """The library called directly, with an ISA forced (2 = AVX2 + FMA, 0 = portable)."""
    lib = invariant_gemm.load()
    out = torch.empty(x.shape[0], w.shape[0])
    lib.gemm(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), None if b is None else b.data_ptr(),
             out.data_ptr(), out.stride(0), x.shape[0], w.shape[0], x.shape[1], lib.isa if isa is None else isa)
    return out


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k", [1, 7, 8, 13, 64, 515, 2048])
@pytest.mark.parametrize("n", [1, 5, 24, 25, 97])
def test_every_row_gets_the_same_bits_alone_in_any_batch_and_at_any_position(k, n):
    x, w, b = rand(37, k), rand(n, k, seed=1), rand(n, seed=2)
    together = invariant_gemm.linear(x, w, b)
    for i in range(37):  # alone (M = 1), in batches of every size and at every position of them
        assert torch.equal(invariant_gemm.linear(x[i:i + 1].clone(), w, b), together[i:i + 1])
    for m in (2, 3, 4, 5, 9, 16, 33):
        for start in (0, 1, 37 - m):
            assert torch.equal(invariant_gemm.linear(x[start:start + m], w, b), together[start:start + m])


def test_other_rows_contents_do_not_matter():
    x, w = rand(16, 300), rand(70, 300, seed=1)
    noisy = x.clone()
    noisy[1:] = rand(15, 300, seed=3) * 1e6  # every other row huge
    noisy[5] = float("inf")
    assert torch.equal(invariant_gemm.linear(noisy, w)[0], invariant_gemm.linear(x, w)[0])


def test_the_portable_kernel_runs_the_same_operations_as_the_avx2_one():
    # So a CPU without AVX2 gets the same bits as one with it.
    for k, n in ((5, 3), (64, 24), (515, 50), (1024, 97)):
        x, w, b = rand(11, k), rand(n, k, seed=1), rand(n, seed=2)
        assert torch.equal(gemm(x, w, b, isa=0), gemm(x, w, b, isa=2)), (k, n)


def test_it_computes_the_product_within_float32_rounding():
    x, w, b = rand(9, 2048), rand(200, 2048, seed=1), rand(200, seed=2)
    exact = F.linear(x.double(), w.double(), b.double())
    assert (invariant_gemm.linear(x, w, b).double() - exact).abs().max() < 2e-4  # float32 over K = 2048


def test_strided_and_batched_inputs_give_the_rows_of_a_plain_matrix():
    w = rand(40, 64, seed=1)
    x = rand(3, 5, 64)
    flat = invariant_gemm.linear(x.reshape(15, 64), w)
    assert torch.equal(invariant_gemm.linear(x, w), flat.view(3, 5, 40))
    wide = rand(15, 128)
    view = wide[:, ::2]  # inner stride 2: copied first
    assert torch.equal(invariant_gemm.linear(view, w), invariant_gemm.linear(view.contiguous(), w))
    column_view = wide[:, :64]  # row stride 128: read in place
    assert torch.equal(invariant_gemm.linear(column_view, w), invariant_gemm.linear(column_view.contiguous(), w))


def test_covers_only_float32_cpu_outside_autograd():
    x, w = rand(2, 8), rand(4, 8)
    assert invariant_gemm.covers(x, w, None)
    assert not invariant_gemm.covers(x.bfloat16(), w.bfloat16(), None)
    assert not invariant_gemm.covers(x, w.t(), None)  # a transposed weight
    assert not invariant_gemm.covers(x.requires_grad_(), w, None)


def test_an_invalid_shape_is_an_error_not_a_read_past_the_buffer():
    with pytest.raises(RuntimeError, match="8 features"):
        invariant_gemm.linear(rand(2, 8), rand(4, 9))


def test_the_library_is_built_once_per_source_and_loads_its_entry_points():
    lib = ctypes.CDLL(str(invariant_gemm.load().path))
    assert lib.omni_gemm_isa() in (0, 2)
    assert invariant_gemm.load() is invariant_gemm.load()
    assert invariant_gemm._library_name().startswith("omni_invariant_gemm-")


# Exact mode's GEMM path (services/runtime/lm/kernels.py): every float32 linear of the process, any batch.

def test_gemm_kernels_route_every_linear_through_the_invariant_gemm():
    x, w, b = rand(6, 1, 96), rand(50, 96, seed=1), rand(50, seed=2)
    with using_kernels(GEMM_KERNELS):
        assert torch.equal(F.linear(x, w, b), invariant_gemm.linear(x, w, b))  # outside an exact block too
        with batch_invariant():
            assert torch.equal(F.linear(x, w, b), invariant_gemm.linear(x, w, b))
        assert torch.equal(F.linear(x.bfloat16(), w.bfloat16()), batching._original_linear(x.bfloat16(), w.bfloat16()))
    assert torch.equal(F.linear(x, w, b), batching._original_linear(x, w, b))  # restored


def test_gemm_experts_give_every_token_its_alone_bits_in_any_batch():
    module = experts_module(8, 64, 48)
    g = torch.Generator().manual_seed(1)
    tokens, top_k = 19, 3
    states = torch.randn(tokens, 64, generator=g)
    index = torch.stack([torch.randperm(8, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    assert batching._gemm_experts_cover(module, states)
    together = batching._gemm_experts(module, states, index, weights)
    for i in range(tokens):
        assert torch.equal(batching._gemm_experts(module, states[i:i + 1], index[i:i + 1], weights[i:i + 1]),
                           together[i:i + 1])
    for start, m in ((0, 2), (3, 7), (10, 9)):
        part = batching._gemm_experts(module, states[start:start + m], index[start:start + m], weights[start:start + m])
        assert torch.equal(part, together[start:start + m])
    # and the product is the experts' own, within float32 rounding
    from transformers.integrations.moe import grouped_mm_experts_forward

    plain = grouped_mm_experts_forward(module, states, index, weights)
    assert (together - plain).abs().max() < 1e-5
