"""Batched decode on transformers modules: fixed-capacity KV slots and batch-invariant kernels.

Prefill runs one request at a time through the module's own code path (a DynamicCache), exactly
as `generate` does; its keys and values are then copied into the request's slot of a KV cache
allocated once at start-up. Decode steps of many requests run as one batch: the projections,
MLPs and MoE experts see [batch, ...] inputs, while attention runs per row over that row's own
slot (a custom attention function registered with transformers), so requests of different
lengths share a step without padding; where exact batching is off (the GPU default), one batched
SDPA over the positions the batch's rows use (`SlotSpan`, `span_attention`).

NOTE: exactness. A GEMM over B rows does not give bit-identical rows to B separate GEMVs
(different CPU kernels and blocking; measured up to 1e-4 absolute on 2048-wide layers), and
whether a batched kernel happens to match is a property of one kernel on one CPU (batched SDPA
matched on an Intel host and not on AMD ones). Greedy decoding must not depend on who else is in
the batch, so exact mode (`batch_invariant`) computes every op along one of these paths, chosen
once per engine (`ExactKernels`, from the start-up check in services/runtime/lm/invariance.py):

Each engine enters its choice (`using_kernels`) around its model work, on the thread that runs it.

- ROWS, invariant by construction: one call per request row of the op `generate` itself calls,
  with the shape that row has alone ([1, T, K] for a linear layer, one token for the experts,
  [1, heads, T, L] for attention). Same kernel, same shape, same thread count, same input bits:
  the same output bits, whatever the batch. It costs one kernel launch and one weight read per row.
- BATCHED, invariant where checked: one bmm with an item per row (`rowwise_matmul`), the experts'
  per-pair bmm (`_batched_experts`), one SDPA over equal-length rows. Used only where the check
  found it bit-identical to ROWS on this CPU, at this thread count, for the shapes the engine runs.
- GEMM (`--exact-batching gemm`): omni's own GEMM (services/runtime/lm/invariant_gemm.py), whose
  per-element operations are fixed in its source, so no check is needed; it is applied to every
  float32 linear layer of the process (prefill, encoders and decode), and exact against
  `generate` run through the same op. It reuses each weight across the batch's rows.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import threading
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from services.runtime.lm import invariant_gemm

ROWWISE_ATTENTION = "omni_rowwise"
INVARIANT_ATTENTION = "omni_invariant"  # --exact-batching gemm's thinker attention (`invariant_attention`)
_original_linear = F.linear
_original_activations = {"sigmoid": F.sigmoid, "silu": F.silu}  # torch's own, before `_install`
_local = threading.local()


class KernelPath(enum.StrEnum):
    ROWS = "rows"  # one call per row with the row's own shape: invariant by construction
    BATCHED = "batched"  # one batched call: invariant where the start-up check passed
    GEMM = "gemm"  # omni's invariant GEMM (linear layers and experts only)


@dataclass(frozen=True)
class ExactKernels:
    """How exact mode computes each batched op (an engine's checked choice, services/runtime/lm/invariance.py)."""

    linear: KernelPath = KernelPath.ROWS
    experts: KernelPath = KernelPath.ROWS
    attention: KernelPath = KernelPath.ROWS  # equal-length rows in one SDPA (the code predictor)
    # With linear BATCHED: the (out, in, tokens per row) cases the check found invariant; any other
    # linear (a shape it did not run, or one that differed) goes row by row. None: every shape
    # (only tests that force the batched path use it; the check always lists its cases).
    linear_shapes: frozenset[tuple[int, int, int]] | None = frozenset()

    def batched_linear(self, weight: torch.Tensor, tokens: int) -> bool:
        return self.linear is KernelPath.BATCHED and (self.linear_shapes is None
                                                     or (*weight.shape, tokens) in self.linear_shapes)


_ROWS = ExactKernels()


def exact_kernels() -> ExactKernels:
    """The paths in force on this thread: ROWS outside an engine's `using_kernels` block."""
    return getattr(_local, "kernels", _ROWS)


@contextlib.contextmanager
def using_kernels(kernels: ExactKernels):
    """These paths on this thread inside the block (an engine's step, the reference's generate).
    GEMM puts the F.linear replacement in place (every float32 linear layer the block runs)."""
    if kernels.linear is KernelPath.GEMM:
        _install()
    previous = getattr(_local, "kernels", _ROWS)
    _local.kernels = kernels
    try:
        yield kernels
    finally:
        _local.kernels = previous


GEMM_KERNELS = ExactKernels(KernelPath.GEMM, KernelPath.GEMM, KernelPath.ROWS)


# torch.bmm computes problems with T*K*N below this with a naive loop, not the GEMV/GEMM kernels
# F.linear uses, which rounds differently (measured: 380 differs, 400 matches).
_BMM_KERNEL_MIN_SIZE = 400


# A per-row product reads the whole weight once per row. A weight larger than the L2 cache is
# multiplied a column tile at a time instead (about 1 MB of it), so the tile stays in cache across
# the batch's rows; each output element is still one GEMV's dot product over the whole K, so the
# bits do not change. Measured (1 thread, batch 16, [K, N] float32): 512 x 1536 1525 -> 820 us,
# 1536 x 512 1528 -> 821 us, 1024 x 3072 7186 -> 3291 us; at 1 MB and below it is slower.
_TILE_BYTES = 1 << 20
_TILE_MIN_BYTES = 3 << 19


def tile_columns(weight: torch.Tensor, tokens: int) -> int | None:
    """Output columns per tile for `rowwise_matmul`, or None to multiply the weight whole.
    Only for one token per row on one thread: there every tiling was checked bit-identical
    (tests/runtime/lm/test_kernels.py); with more threads MKL's GEMV splits its work by shape."""
    n_out, k = weight.shape
    size = weight.element_size()
    if tokens != 1 or n_out * k * size < _TILE_MIN_BYTES or torch.get_num_threads() != 1:
        return None
    return max(64, _TILE_BYTES // (k * size) // 64 * 64)


def rowwise_matmul(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [B, T, K] @ weight[N, K].T (+ bias) with one bmm item per row (the BATCHED linear:
    bit-identical to each row's own `F.linear` where the check says so); column-tiled for
    weights past L2 size."""
    batch, tokens = rows.shape[:2]
    transposed = weight.t()  # [K, N], no copy
    cols = tile_columns(weight, tokens)
    if cols is None:
        weights = transposed.unsqueeze(0).expand(batch, -1, -1)  # [B, K, N], no copy
        # baddbmm rounds bias + product once, as F.linear does (a separate add rounds twice in bf16).
        return (torch.bmm(rows, weights) if bias is None
                else torch.baddbmm(bias.expand(batch, tokens, -1), rows, weights))
    n_out = weight.shape[0]
    out = rows.new_empty((batch, tokens, n_out))
    for start in range(0, n_out, cols):
        end = min(start + cols, n_out)
        weights = transposed[:, start:end].unsqueeze(0).expand(batch, -1, -1)
        if bias is None:
            torch.bmm(rows, weights, out=out[:, :, start:end])
        else:
            torch.baddbmm(bias[start:end].expand(batch, tokens, -1), rows, weights, out=out[:, :, start:end])
    return out


def _alone(row: torch.Tensor) -> torch.Tensor:
    """A row as `generate` would hold it alone: at an address of torch's own alignment (64 bytes),
    so a BLAS whose blocking follows alignment sees the same input."""
    return row if row.data_ptr() % 64 == 0 else row.clone()


def row_alone(function, *args):
    """`function(*args)` for one request's row, with the shapes it has alone: every ROWS call of
    exact mode goes through here, so what runs inside is that request's own computation by
    construction (tests/op_audit.py accepts it as such and judges every op outside)."""
    return function(*args)


def each_row(function, rows: torch.Tensor, *rest) -> torch.Tensor:
    """`function(row, *rest)` for each row of `rows` (dim 0: one request each) alone, concatenated."""
    return torch.cat([row_alone(function, rows[i:i + 1], *rest) for i in range(rows.shape[0])])


def linear_rows(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [B, T, K] (or [R, K]) -> each row through `F.linear` alone, [1, T, K] (or [1, K]) as its
    own request's forward calls it: the ROWS linear."""
    return torch.cat([row_alone(_original_linear, _alone(rows[i:i + 1]), weight, bias) for i in range(rows.shape[0])])


def exact_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer over rows [B, T, K] of B requests along this process's exact path."""
    if exact_kernels().linear is KernelPath.GEMM and invariant_gemm.covers(rows, weight, bias):
        return invariant_gemm.linear(rows, weight, bias)
    if rows.shape[0] <= 1:
        return _original_linear(rows, weight, bias)
    if exact_kernels().batched_linear(weight, rows.shape[1]) and \
            rows.shape[1] * weight.shape[1] * weight.shape[0] >= _BMM_KERNEL_MIN_SIZE:
        return rowwise_matmul(rows, weight, bias)
    return linear_rows(rows, weight, bias)


def _batch_invariant_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    # GEMM: every float32 linear layer in the engine's (or the reference's) block, any batch, any
    # shape. Otherwise, in an exact block: [B, T, K]: B requests of T tokens each; [R, K]: R
    # single-token requests; else unchanged.
    if exact_kernels().linear is KernelPath.GEMM and invariant_gemm.covers(input, weight, bias):
        return invariant_gemm.linear(input, weight, bias)
    if not getattr(_local, "active", False) or input.ndim not in (2, 3) or input.shape[0] <= 1:
        return _original_linear(input, weight, bias)
    return exact_linear(input if input.ndim == 3 else input.unsqueeze(1), weight, bias).view(*input.shape[:-1], -1)


# ATen's CPU elementwise loops run whole pairs of vectors and the last n % (2 * lanes) elements of
# a run through the scalar function (for exp: libm's, not Sleef's; other last bits on about 4 % of
# inputs). A run is the whole contiguous tensor below ATen's grain size (one thread), a thread's
# share above it. So a row keeps the bits it has alone only where both runs are whole pairs of the
# widest vectors (AVX512: 2 x 64 bytes) and the op runs on one thread.
_WIDEST_PAIR_BYTES = 128
_ATEN_GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE


def whole_vectors(input: torch.Tensor) -> bool:
    """An elementwise op over `input` runs every element, and every row's alone, on the vector path."""
    return (input.is_contiguous() and input.numel() <= _ATEN_GRAIN_SIZE
            and input.shape[-1] % (_WIDEST_PAIR_BYTES // input.element_size()) == 0)


def exact_activation(name: str, input: torch.Tensor) -> torch.Tensor:
    """An exp-based activation (sigmoid, silu) along this process's exact path. GEMM: the invariant
    kernels' scalar form for every element (any rows, any size; the reference runs it too). In an
    exact block, over rows [B, ...] of B requests: one call where every row is whole vectors, else
    one call per row with the shape the row has alone (ROWS)."""
    original = _original_activations[name]
    if exact_kernels().linear is KernelPath.GEMM and invariant_gemm.covers_elementwise(input) \
            and invariant_gemm.load() is not None:
        return invariant_gemm.elementwise(name, input)
    if not getattr(_local, "active", False) or input.ndim < 2 or input.shape[0] <= 1 or whole_vectors(input):
        return original(input)
    return each_row(original, input)


def _exact_sigmoid(input: torch.Tensor) -> torch.Tensor:
    return exact_activation("sigmoid", input)


def _exact_silu(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    out = exact_activation("silu", input)
    return input.copy_(out) if inplace else out


class _ScalarTrigonometry(TorchFunctionMode):
    """cos and sin (as functions or tensor methods) of float32 CPU tensors through the invariant
    kernels' scalar form, inside the block."""

    NAMES = {torch.cos: "cos", torch.Tensor.cos: "cos", torch.sin: "sin", torch.Tensor.sin: "sin"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = self.NAMES.get(func)
        if name is not None and not kwargs and len(args) == 1 and invariant_gemm.covers_elementwise(args[0]):
            return invariant_gemm.elementwise(name, args[0])
        return func(*args, **(kwargs or {}))


class _RowsApart(TorchFunctionMode):
    """`rows_apart`'s mode: each op whose CPU kernel may give a row of dim 0 other bits beside others
    than alone runs once per row, with the row's own shape (`row_alone`)."""

    # Convolutions (oneDNN blocks by batch: measured on AVX512), attention, and the transcendental
    # elementwise ops where the row is not whole vectors (the vector/scalar split, `whole_vectors`).
    CONVOLUTIONS = {torch.conv1d, torch.conv_transpose1d, torch.conv2d}
    ELEMENTWISE = {torch.sin, torch.Tensor.sin, torch.cos, torch.Tensor.cos, torch.exp, torch.Tensor.exp,
                   torch.tanh, torch.Tensor.tanh, torch.erf, torch.Tensor.erf, torch.log, torch.Tensor.log,
                   torch._C._nn.gelu, torch.sigmoid, torch.Tensor.sigmoid}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is None or first.ndim < 2 or first.shape[0] <= 1:
            return func(*args, **kwargs)
        batch = first.shape[0]
        if func in self.CONVOLUTIONS or (func in self.ELEMENTWISE and not whole_vectors(first)):
            return each_row(partial(func, **kwargs), first, *args[1:])
        if func is F.scaled_dot_product_attention:
            mask = kwargs.pop("attn_mask", None)
            q, k, v = args[:3]

            def attend(i: int) -> torch.Tensor:
                row_mask = mask[i:i + 1] if mask is not None and mask.shape[0] == batch else mask
                return row_alone(partial(func, attn_mask=row_mask, **kwargs), q[i:i + 1], k[i:i + 1], v[i:i + 1])

            return torch.cat([attend(i) for i in range(batch)])
        return func(*args, **kwargs)


@contextlib.contextmanager
def rows_apart():
    """Inside the block, on this thread, the batch's rows (dim 0: one request each) keep the bits
    each gets alone by construction: linear layers and the exact activations along exact mode's
    ROWS path (`batch_invariant`), convolutions, attention and transcendental elementwise ops that
    are not whole vectors once per row (`_RowsApart`); what is left is row-independent by kind
    (moves, single IEEE operations, reductions within a row: tests/op_audit.py). For a model whose
    every op takes its batch along dim 0 (code2wav's decoder)."""
    with batch_invariant(True), _RowsApart():
        yield


def _exact_rotary(forward, x: torch.Tensor, position_ids: torch.Tensor):
    """A text rotary embedding's forward (x [B, T, H], position ids [..., B, T] -> cos, sin [B, T, D])
    along the exact path. Its cos and sin run over [sections, B, T, D / 2], where an element's place
    decides its path as for the activations (`whole_vectors`). GEMM: every cos and sin by the
    invariant kernels' scalar form (the reference runs it too). In an exact block, a batch of B
    requests: one call per request with the position ids it has alone (ROWS)."""
    if exact_kernels().linear is KernelPath.GEMM and x.device.type == "cpu" and invariant_gemm.load() is not None:
        with _ScalarTrigonometry():
            return forward(x, position_ids)
    batch = x.shape[0]
    if not getattr(_local, "active", False) or batch <= 1 or position_ids.shape[-2] != batch:
        return forward(x, position_ids)
    rows = [row_alone(forward, x[i:i + 1], position_ids[..., i:i + 1, :]) for i in range(batch)]
    return tuple(torch.cat(parts) for parts in zip(*rows))


def use_exact_rotary(model: torch.nn.Module) -> None:
    """Every text rotary embedding under `model` (a forward of (x, position_ids)) along `_exact_rotary`:
    outside exact mode and for one request it is the module's own forward."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and not hasattr(module, "_omni_forward") \
                and "position_ids" in inspect.signature(module.forward).parameters:
            module._omni_forward = module.forward
            module.forward = partial(_exact_rotary, module._omni_forward)


_EXACT_FUNCTIONS = {"linear": _batch_invariant_linear, "sigmoid": _exact_sigmoid, "silu": _exact_silu}


def _install() -> None:
    """Put the exact linear and activations in torch.nn.functional's place, for the process
    (idempotent): transformers' modules call F.linear, F.silu (SiLU) and F.sigmoid (the talker's
    shared-expert gate) through the module."""
    for name, function in _EXACT_FUNCTIONS.items():
        if getattr(F, name) is not function:
            setattr(F, name, function)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Within this block, on this thread, linear layers compute each request separately (along the
    process's `ExactKernels` path).

    NOTE: transformers' modules call `F.linear` directly (nn.Linear, the MoE routers), so the
    first block that enables this puts `_batch_invariant_linear` in its place, for the process.
    Outside an enabled block, on any thread, it is the plain `F.linear` plus one attribute read;
    a process that never enables exact batching never replaces anything."""
    if enabled:
        _install()
    previous = getattr(_local, "active", False)
    _local.active = enabled
    try:
        yield
    finally:
        _local.active = previous


class RowKV(list):
    """Per-row key (or value) tensors of a batch, each [1, kv_heads, length_i, head_dim]."""


@dataclass(frozen=True)
class SlotSpan:
    """Keys (or values) of a decode batch in one tensor, [B, kv_heads, L, head_dim]: the first L positions
    of each row's slot, and which of them each query row sees (`visible` [B, T, L] bool: a row's own
    positions up to its query's). What the batched attention takes where exact batching is off."""
    states: torch.Tensor
    visible: torch.Tensor


def span_attention(query: torch.Tensor, key: SlotSpan, value: SlotSpan, scaling: float | None) -> torch.Tensor:
    """query [B, heads, T, head_dim] over each row's visible positions -> [B, T, heads, head_dim], in one
    SDPA over the batch.

    NOTE: GQA without copies. transformers' SDPA path expands keys and values to every query head
    (`repeat_kv`, 8x at the full-size thinker) whenever a mask is passed, because cuda's SDPA takes
    `enable_gqa` only without one (flash). Here the query heads that share a kv head are folded into
    the query rows instead ([B, kv_heads, groups * T, head_dim]: head kv * groups + g, token t is row
    g * T + t), so every kernel, masked or not, reads each key and value once. Same math: each query
    head attends over its own kv head's keys, as with the expansion."""
    batch, heads, tokens, dim = query.shape
    kv_heads = key.states.shape[1]
    groups = heads // kv_heads
    rows = query.reshape(batch, kv_heads, groups * tokens, dim)
    visible = key.visible[:, None]  # [B, 1, T, L]
    if groups > 1 and tokens > 1:
        visible = visible.repeat(1, 1, groups, 1)  # row g * T + t sees what token t sees
    out = F.scaled_dot_product_attention(rows, key.states, value.states, attn_mask=visible, scale=scaling)
    return out.view(batch, heads, tokens, dim).transpose(1, 2)


def _rowwise_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(key, SlotSpan):  # a decode batch in one call (exact batching off; the CUDA graphs' step)
        return span_attention(query, key, value, kwargs.get("scaling")), None
    if not isinstance(key, RowKV):  # a single request (prefill): plain SDPA, as transformers runs it
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # query: [B, heads, T, head_dim]; each row attends only to its own slot.
    outputs = [
        row_alone(partial(sdpa_attention_forward, **kwargs), module, query[i:i + 1], key[i], value[i], None)[0]
        for i in range(query.shape[0])
    ]
    return torch.cat(outputs, dim=0), None  # [B, T, heads, head_dim]


def invariant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention whose every output row has the same bits for any number of query rows: the
    thinker's attention with --exact-batching gemm, and generate's in that mode's oracle.

    NOTE: why. SDPA's CPU kernel cuts the queries into blocks whose size depends on how many
    queries there are, so a prompt's last row, computed alone after cached keys (the prefix
    cache) or with the whole prompt, goes through matrix products of different shapes and can
    differ in its last bits (measured: a 129-token prompt from 112 cached tokens). Here each head
    is three steps whose per-row results cannot depend on the query count: scores = q k^T through
    the invariant GEMM (each score a dot product over head_dim in one order), the causal mask
    (query i of T sits at key position K - T + i: a prompt's rows after its cached keys, or one
    decode row) and a row-wise softmax over all K keys, then probs v through the invariant GEMM
    (each output a sum over all K keys in one order, masked keys adding zeros). The number of
    keys is the prompt's (or the slot's) length either way. `attention_mask` is None: transformers
    builds none for an implementation it does not know, and none is needed for one request."""
    if isinstance(key, RowKV):  # a decode batch: each row over its own slot's keys
        return torch.cat([invariant_attention(module, query[i:i + 1], key[i], value[i], None, scaling)[0]
                          for i in range(query.shape[0])]), None
    if not invariant_gemm.covers(query, key[0, 0], None) or invariant_gemm.load() is None:
        raise RuntimeError("invariant attention needs float32 CPU tensors and the invariant GEMM library")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    heads, kv_heads, rows, keys = query.shape[1], key.shape[1], query.shape[2], key.shape[2]
    visible = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
    out = torch.empty(query.shape[0], rows, heads, query.shape[-1], dtype=query.dtype)
    for b in range(query.shape[0]):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = invariant_gemm.linear(query[b, h].contiguous(), key[b, kv].contiguous()) * scale
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            out[b, :, h] = invariant_gemm.linear(probs, value[b, kv].t().contiguous())
    return out, None


def use_invariant_attention(*configs) -> None:
    """These (text) configs' attention through `invariant_attention`."""
    from transformers import AttentionInterface

    AttentionInterface.register(INVARIANT_ATTENTION, invariant_attention)
    for config in configs:
        config._attn_implementation = INVARIANT_ATTENTION


ROWWISE_EXPERTS = "omni_rowwise_experts"


def _rowwise_experts(module, hidden_states, top_k_index, top_k_weights):
    """MoE experts along the process's exact path. transformers groups a batch's tokens by expert
    into one matmul per expert (its `grouped_mm`), whose rounding depends on how many tokens share
    the expert. ROWS: each token through the configured experts alone, as its own request's
    decode step calls them. BATCHED (where checked): `_batched_experts`, every (token, expert) pair
    its own bmm item. GEMM: `_gemm_experts` for any number of tokens, prefill included (the
    reference runs the same)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

    base = ALL_EXPERTS_FUNCTIONS.get_interface(module.config._omni_base_experts, type(module).forward.__wrapped__)
    path = exact_kernels().experts
    if path is KernelPath.GEMM and _gemm_experts_cover(module, hidden_states):
        return _gemm_experts(module, hidden_states, top_k_index, top_k_weights)
    if not getattr(_local, "active", False) or hidden_states.shape[0] <= 1:
        return base(module, hidden_states, top_k_index, top_k_weights)
    if (path is KernelPath.BATCHED and base is grouped_mm_experts_forward
            and _batched_experts_cover(module, hidden_states)):
        return _batched_experts(module, hidden_states, top_k_index, top_k_weights)
    return experts_rows(base, module, hidden_states, top_k_index, top_k_weights)


def experts_rows(base, module, hidden_states, top_k_index, top_k_weights):
    """The ROWS experts: each token [1, H] through `base` alone."""
    return torch.cat([row_alone(base, module, hidden_states[i:i + 1], top_k_index[i:i + 1], top_k_weights[i:i + 1])
                      for i in range(hidden_states.shape[0])])


def _experts_layout_is_plain(module) -> bool:
    # Gated, no biases, [E, out, in] weights: the Qwen3-Omni experts (and what both fast paths cover).
    return (not getattr(module, "_is_expert_parallel", False) and getattr(module, "has_gate", False)
            and not getattr(module, "has_bias", True) and not getattr(module, "is_transposed", True))


def _batched_experts_cover(module, hidden_states) -> bool:
    if hidden_states.device.type != "cpu" or not _experts_layout_is_plain(module):
        return False
    two_inter, hidden = module.gate_up_proj.shape[1:]
    # Below the bmm kernel size bmm rounds differently (see _BMM_KERNEL_MIN_SIZE).
    return min(two_inter * hidden, hidden * two_inter // 2) >= _BMM_KERNEL_MIN_SIZE


def _gemm_experts_cover(module, hidden_states) -> bool:
    return (_experts_layout_is_plain(module) and hidden_states.shape[0] > 0
            and invariant_gemm.covers(hidden_states, module.gate_up_proj[0], None)
            and invariant_gemm.covers(hidden_states, module.down_proj[0], None))


def _per_expert(module, hidden_states, top_k_index, top_k_weights, matmul):
    """hidden_states [N, H], top_k_index / top_k_weights [N, k] -> [N, H]: per expert, its pairs'
    rows through `matmul(rows [n, 1, K], weight [out, K]) -> [n, 1, out]` (gate_up, the gate as the
    module applies it, down), times the routing weight; each row's k results summed in its top-k
    order, one add at a time (elementwise adds: no reduction whose order could follow the batch)."""
    tokens, top_k = top_k_index.shape
    hidden = hidden_states.shape[-1]
    flat = top_k_index.reshape(-1)
    weights = top_k_weights.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=module.num_experts)[: module.num_experts].tolist()
    pairs = None  # [N * k, H] in the dtype of the weighted products (the sum's dtype in the module)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        chosen = order[start:start + n]
        start += n
        rows = hidden_states[chosen // top_k].to(module.gate_up_proj.dtype).unsqueeze(1)  # [n, 1, H]
        gate_up = matmul(rows, module.gate_up_proj[expert])[:, 0]
        projected = module._apply_gate(gate_up)  # [n, I]
        projected = projected.to(module.down_proj.dtype).unsqueeze(1)
        weighted = matmul(projected, module.down_proj[expert])[:, 0] * weights[chosen, None]
        if pairs is None:
            pairs = weighted.new_zeros((tokens * top_k, hidden))
        pairs[chosen] = weighted
    return pairs.view(tokens, top_k, hidden)


def _batched_experts(module, hidden_states, top_k_index, top_k_weights):
    """grouped_mm_experts_forward of every row alone, in one pass (the BATCHED experts): each pair
    one bmm item (the weight expanded, not copied); the k results summed over the k axis in top-k
    order, as the single-row forward sums them."""
    pairs = _per_expert(module, hidden_states, top_k_index, top_k_weights, rowwise_matmul)
    return pairs.sum(dim=1).to(hidden_states.dtype)


def _gemm_experts(module, hidden_states, top_k_index, top_k_weights):
    """The GEMM experts: each expert's pairs through the invariant GEMM at once, the k results
    added in top-k order one at a time."""
    pairs = _per_expert(module, hidden_states, top_k_index, top_k_weights,
                        lambda rows, weight: invariant_gemm.linear(rows, weight))
    total = pairs[:, 0]
    for j in range(1, pairs.shape[1]):
        total = total + pairs[:, j]
    return total.to(hidden_states.dtype)


def use_rowwise_attention(*configs) -> None:
    """Switch these (text) configs to the row-wise attention and experts; with one request both
    are exactly what transformers runs (SDPA; its configured experts implementation). A decode
    batch whose cache gives one `SlotSpan` (exact batching off) attends in one call
    (`span_attention`); one that gives `RowKV` (exact mode), row by row."""
    from transformers import AttentionInterface

    AttentionInterface.register(ROWWISE_ATTENTION, _rowwise_attention)
    for config in configs:
        config._attn_implementation = ROWWISE_ATTENTION
    use_exact_experts(*configs)


@contextlib.contextmanager
def sdpa_prefill(config):
    """Inside the block, `config`'s model runs transformers' own SDPA attention, mask included.

    NOTE: the row-wise attention's one-request path is SDPA, but transformers builds attention
    masks only for implementations it knows, and without one SDPA's is_causal aligns the causal
    mask to the first key: right when the queries are all the keys (a fresh prefill, where SDPA's
    mask function builds no mask either: the same call), wrong for a prefill after cached keys
    (the prefix cache: query i sees keys up to past + i). Such a prefill runs as "sdpa" itself."""
    previous = config._attn_implementation
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = previous


def attention_after_cached_keys(config, cached: bool):
    """The attention a prefill after `cached` keys runs: SDPA with its real mask where the row-wise
    attention would have none (`sdpa_prefill`), the invariant attention as it is (it masks by the
    query's position itself), nothing changed without cached keys."""
    if cached and config._attn_implementation == ROWWISE_ATTENTION:
        return sdpa_prefill(config)
    return contextlib.nullcontext()


def use_exact_experts(*configs) -> None:
    """Switch these configs' MoE experts (where they have any) to `_rowwise_experts`, which is the
    configured implementation itself outside exact mode and for one token."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(ROWWISE_EXPERTS, _rowwise_experts)
    for config in configs:
        current = getattr(config, "_experts_implementation", None)
        if current is not None and current != ROWWISE_EXPERTS:
            config._omni_base_experts = current
            config._experts_implementation = ROWWISE_EXPERTS


def use_capturable_experts(*configs, dtype: torch.dtype) -> None:
    """CUDA graphs: transformers' grouped_mm experts run weights other than bfloat16 through a
    fallback that reads each expert's token count on the host (a device-to-host copy inside the
    step, which capture forbids; seen on an H200 in float32). Those configs run batched_mm, which
    gathers each (token, expert) pair's weights on the device: capturable in any dtype. The
    choice is the model's, so the eager steps of the same model run it too."""
    if dtype == torch.bfloat16:
        return
    for config in configs:
        name = "_omni_base_experts" if getattr(config, "_experts_implementation", None) == ROWWISE_EXPERTS \
            else "_experts_implementation"
        if getattr(config, name, None) == "grouped_mm":
            setattr(config, name, "batched_mm")


def fused_rms_norm(norm, hidden_states: torch.Tensor) -> torch.Tensor:
    """A Qwen RMSNorm (`weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`, in float32) as one
    `F.rms_norm` call: one op where the module's forward is eight (two casts, pow, mean, add, rsqrt,
    two muls). The same math; in reduced precision not the same bits (the weight multiplies before
    the cast back: one rounding, not two), so only where exactness is not promised."""
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), norm.weight, norm.variance_epsilon)


def fuse_rms_norms(module: torch.nn.Module) -> int:
    """Every Qwen RMSNorm under `module` runs `fused_rms_norm` (an instance attribute: the class and
    other models keep theirs). For the decode steps CUDA graphs capture (exact batching is off
    there): 7 of every 8 norm kernels gone. Returns how many were fused."""
    fused = 0
    for norm in module.modules():
        weight = getattr(norm, "weight", None)
        if type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon") \
                and isinstance(weight, torch.Tensor) and weight.ndim == 1:
            norm.forward = fused_rms_norm.__get__(norm)
            fused += 1
    return fused
