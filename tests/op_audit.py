"""Every aten op of an exact forward, seen and judged (project issue 55, item 2).

"Exact by construction" is a claim about every op a forward runs, not about the ops we thought of:
the talker's shared-expert sigmoid broke it on AVX512 although every op on the list was invariant.
`OpAudit` is a TorchDispatchMode that sees each aten op an engine step dispatches and accepts it only
where its kind is row-independent for the shapes it is called with; anything else is refused, and a
new op or shape that a model brings fails the test until it joins a list here with its reason
(docs/correctness.md, "Every op of an exact forward").

A row is what must keep its bits: a request's row in a decode batch (exact mode `on`), a token's row
in a prefill, a chunk of one or a suffix after cached blocks (`gemm`). The invariant kernels (the
invariant GEMM, attention and activations of services/runtime/lm/invariant_gemm.c) run in C, out of
the dispatcher's sight: what the audit sees is everything else.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.runtime.lm import kernels
from services.runtime.lm.kernels import ExactKernels, KernelPath, whole_vectors

# Views and metadata: no arithmetic.
VIEWS = {
    "view", "_unsafe_view", "reshape", "alias", "as_strided", "expand", "permute", "transpose", "t", "slice",
    "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "chunk", "narrow", "detach",
    "unfold", "lift_fresh", "_reshape_alias", "view_as_real", "diagonal", "movedim", "detach_",
}
# Copies, creation, indexing, comparisons, integer and boolean work: each output element is an input
# element (or a constant), moved, never rounded.
MOVES = {
    "copy_", "clone", "contiguous", "_to_copy", "to", "cat", "stack", "index", "index_select", "index_put_",
    "index_put", "index_copy_", "index_copy", "gather", "scatter", "scatter_", "embedding", "masked_fill",
    "masked_fill_", "where", "fill_", "zero_", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
    "empty", "empty_like", "empty_strided", "new_empty", "new_zeros", "new_ones", "new_full", "arange",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or",
    "bitwise_not", "bitwise_xor", "tril", "triu", "repeat", "repeat_interleave", "flip", "roll", "nonzero",
    "masked_select", "sort", "argsort", "bincount", "isin", "any", "all", "isnan", "isinf",
    "isfinite", "clamp", "clamp_", "clamp_min", "clamp_max", "maximum", "minimum", "abs", "sign", "remainder",
    "floor_divide", "_local_scalar_dense", "item", "equal", "constant_pad_nd", "pad", "resize_", "set_",
    "scalar_tensor", "_assert_async", "max_pool1d", "topk", "argmax", "max", "min", "amax", "amin", "select_scatter",
    "slice_scatter", "index_add_", "lt_", "one_hot", "ceil", "floor", "round", "trunc",
}
# One IEEE operation per element (+ - * /, sqrt, 1/sqrt, negation): correctly rounded in the vector
# and the scalar paths alike, so the path an element takes cannot change its bits.
EXACT_ARITHMETIC = {
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "neg_", "sqrt", "rsqrt", "reciprocal",
    "square", "rsub",
}
# Vectors and the scalar tail compute these with other functions (Sleef's, libm's): row-independent
# only where every element takes the vector path alone and in the call (`whole_vectors`).
TRANSCENDENTAL = {
    "exp", "exp_", "log", "sigmoid", "silu", "silu_", "gelu", "tanh", "sin", "cos", "erf", "pow", "softplus",
    "log1p", "expm1", "elu", "relu", "leaky_relu", "hardtanh", "atan", "atan2",
}
# Reductions along the last dimension: each output from its own row, by the same serial loop
# whatever the number of rows (ATen parallelizes over the rows below a row of its grain size).
LAST_DIM_REDUCTIONS = {
    "sum", "mean", "_softmax", "softmax", "_log_softmax", "log_softmax", "native_layer_norm", "_fused_rms_norm",
    "rms_norm", "layer_norm", "var", "std", "var_mean", "logsumexp", "norm", "linalg_vector_norm", "prod",
}
# Products: row-independent only as one row's own call (inside `kernels.row_alone`), through the
# invariant GEMM (unseen), or as products of one term (K = 1: one rounding each).
PRODUCTS = {
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_flash_attention_for_cpu",
    "scaled_dot_product_attention", "_scaled_dot_product_attention_math", "convolution", "conv1d",
    "conv_transpose1d", "_convolution", "mkldnn_convolution", "_grouped_mm", "einsum", "addmv", "mv", "dot",
}
ATEN_GRAIN_SIZE = 32768


def _tensors(args) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out


def _last_dim(kwargs: dict, args: tuple, ndim: int, position: int = 1) -> bool:
    dim = kwargs.get("dim", args[position] if len(args) > position else None)
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return dim is not None and dim % max(ndim, 1) == ndim - 1


def verdict(name: str, args: tuple, kwargs: dict) -> str | None:
    """None where the op keeps every row's bits for these arguments; else why not."""
    tensors = _tensors(args)
    first = tensors[0] if tensors else None
    if first is None or name in VIEWS or name in MOVES or name in EXACT_ARITHMETIC:
        return None
    if not first.is_floating_point():
        return None  # integer and boolean arithmetic is exact
    if name == "cumsum" and _small_integers(first):
        return None  # position ids from a float mask: sums of integers below 2^24 are exact in any order
    if name in TRANSCENDENTAL:
        if name == "pow" and len(args) > 1 and not isinstance(args[1], torch.Tensor) and args[1] in (1, 2, 0.5):
            return None  # x * x (ATen special-cases 2), x, sqrt: single IEEE operations
        if whole_vectors(first) or first.numel() == 1:
            return None
        return f"elementwise {name} over {tuple(first.shape)}: not whole pairs of AVX512 vectors on one thread"
    if name in LAST_DIM_REDUCTIONS:
        if name in ("native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm"):
            normalized = args[1]
            ok = len(normalized) == 1
        elif name in ("sum", "mean", "var", "std", "var_mean", "logsumexp", "norm", "linalg_vector_norm", "prod") \
                and len(args) < 2 and "dim" not in kwargs:
            ok = first.ndim <= 1 or all(s == 1 for s in first.shape[:-1])  # a whole reduction of one row
        else:
            ok = _last_dim(kwargs, args, first.ndim) or _within_rows(kwargs, args, first)
        if not ok:
            return f"{name} over {tuple(first.shape)} not along its last dimension"
        if first.ndim and first.shape[-1] > ATEN_GRAIN_SIZE:
            return f"{name} over rows of {first.shape[-1]}: past ATen's grain size, a row may be split across threads"
        return None
    if name in PRODUCTS:
        if name in ("mm", "bmm", "addmm", "baddbmm", "matmul") and _inner(name, tensors) == 1:
            return None
        return f"{name} of {[tuple(t.shape) for t in tensors]}: a product over several rows at once"
    return f"{name}: not on any list (join one, with its reason)"


def _small_integers(t: torch.Tensor) -> bool:
    return bool(torch.equal(t, t.round()) and (t.numel() == 0 or t.abs().max() < 2 ** 24))


def _within_rows(kwargs: dict, args: tuple, t: torch.Tensor) -> bool:
    """A reduction over a middle dimension of rows [R, G, ..., H] (the code predictor's sum of a
    frame's code embeddings, code2wav's mean over the quantizers): each output (r, ..., h) adds its
    G terms in index order; the inner loop runs along H within row r, whole vectors of AVX512 when
    H is a multiple of 32 floats (no tail whose place could move), so nothing about the other rows
    reaches it."""
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return (t.ndim >= 3 and isinstance(dim, int) and 0 < dim % t.ndim < t.ndim - 1
            and t.shape[-1] % (128 // t.element_size()) == 0)


def _inner(name: str, tensors: list[torch.Tensor]) -> int:
    """K of a product: the first factor's last dimension."""
    factor = tensors[1] if name in ("addmm", "baddbmm") else tensors[0]
    return factor.shape[-1]


@dataclass
class OpAudit(TorchDispatchMode):
    """Inside the block, every aten op dispatched on this thread is judged; `refused` keeps the
    ones that failed (op, shapes, why), `seen` counts each op name."""

    refused: list[tuple[str, str]] = field(default_factory=list)
    seen: dict[str, int] = field(default_factory=dict)
    alone: int = 0  # depth of `kernels.row_alone` calls in progress (what runs inside is a row's own)

    def __post_init__(self):
        super().__init__()

    def watching(self, monkeypatch) -> OpAudit:
        """Count `kernels.row_alone`'s calls (every ROWS call of exact mode) as a row's own, wherever
        it was imported."""
        def row_alone(function, *args):
            self.alone += 1
            try:
                return function(*args)
            finally:
                self.alone -= 1

        original = kernels.row_alone
        for module in list(sys.modules.values()):  # the kernels' own and every `from ... import row_alone`
            if getattr(module, "__name__", "").startswith("services.") and getattr(module, "row_alone", None) is original:
                monkeypatch.setattr(module, "row_alone", row_alone)
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.alone:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.seen[name] = self.seen.get(name, 0) + 1
        why = verdict(name, args, kwargs)
        if why is not None and len(self.refused) < 50:
            self.refused.append((str(func), why))
        return func(*args, **kwargs)

    def assert_clean(self, what: str) -> None:
        assert self.seen, f"{what}: no op seen"
        assert not self.refused, f"{what}: ops that may give a row other bits than alone:\n" + "\n".join(
            f"  {op}: {why}" for op, why in dict(self.refused).items())


def by_construction(engine) -> None:
    """The engine on the paths exact by construction (ROWS, or the invariant GEMM): the batched
    kernels a start-up check adopts where it found them invariant on this CPU are that check's to
    prove (services/runtime/lm/invariance.py), not the construction's."""
    kernels = engine.exact_report.kernels
    engine.exact_report = dataclasses.replace(engine.exact_report, kernels=ExactKernels(
        *(KernelPath.GEMM if path is KernelPath.GEMM else KernelPath.ROWS
          for path in (kernels.linear, kernels.experts, kernels.attention))))
