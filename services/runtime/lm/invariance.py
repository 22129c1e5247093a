"""Exact mode's kernel check: which batched kernels give each row its alone-bits on this machine.

A batched kernel (one bmm with an item per row, the experts' per-pair bmm, one SDPA over rows of
equal length) is invariant or not depending on the CPU's ISA, torch's kernel choice for the shapes
and the thread count: batched SDPA matched every row on an Intel host and not on AMD EPYC hosts at
2 threads. So each engine, once its model is loaded and its thread count set, runs every batched
kernel it would use on the shapes it will use (its own weights, random inputs, the batch sizes in
`check_batch_sizes`), rows together against each row alone along the ROWS path, bitwise, and uses a
batched kernel only if every case matched. Anything that raises counts as a mismatch: a failed
check costs speed, never a request. An engine serves on the per-row paths (invariant by
construction; `by_construction`) while the check runs beside serving, and adopts its report
between steps (`exact_check`, services/runtime/checks.py). The choice is logged once and
exported (`omni_exact_kernel_info`, services/serving/metrics.py); the engine enters it around its
model work (`SlotScheduledEngine.kernels`).

What the check cannot see (why the ROWS path is the default, not the batched one): a case it did
not run. It runs the engine's exact weight shapes and token counts at the batch sizes where kernel
heuristics switch (small, powers of two and their neighbours, the capacity), at the thread count
the process keeps for its life (stages set it once at load, services/runtime/model/checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from services.runtime.checks import CheckState, StartupCheck
from services.runtime.lm import invariant_gemm
from services.runtime.lm.kernels import (
    GEMM_KERNELS,
    ExactKernels,
    KernelPath,
    _batched_experts,
    _batched_experts_cover,
    experts_rows,
    linear_rows,
    rowwise_matmul,
)
from services.runtime.model.settings import CheckSettings

log = logging.getLogger(__name__)

# Batch sizes at which kernel heuristics typically switch; the capacity is added.
_BATCHES = (2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64)
# Past this many multiply-adds per (weight, batch) case, fewer batch sizes (a real-width lm head
# is 300 M per row): the check stays a few seconds at start-up.
_FULL_PROBE_MACS = 64 << 20


def check_batch_sizes(capacity: int, macs_per_row: int = 0) -> list[int]:
    sizes = sorted({b for b in _BATCHES if b <= capacity} | ({capacity} if capacity >= 2 else set()))
    if macs_per_row * capacity > _FULL_PROBE_MACS:
        sizes = sorted({b for b in sizes if b in (2, 3, 8, 16)} | {sizes[-1]}) if sizes else []
    return sizes


@dataclass(frozen=True)
class AttentionShape:
    """One batched SDPA the engine runs: query [B, heads, tokens, head_dim] over `length` keys, sliced
    from a buffer of `positions` (0: length + 1) per row."""

    heads: int
    kv_heads: int
    head_dim: int
    tokens: int
    length: int
    causal: bool
    positions: int = 0


@dataclass
class KernelVerdict:
    kernels: ExactKernels
    reasons: dict[str, str] = field(default_factory=dict)  # op -> why it took its path
    seconds: float = 0.0
    more: dict[str, str] = field(default_factory=dict)  # other checked choices, e.g. prefix_hit -> used
    check: CheckState = CheckState.NONE  # where it came from (omni_exact_check)

    def paths(self) -> dict[str, str]:
        """op -> the path it takes (omni_exact_kernel_info)."""
        return {op: getattr(self.kernels, op).value for op in ("linear", "experts", "attention")} | self.more

    def settings(self) -> dict[str, float]:
        return {}

    def line(self) -> str:
        return "; ".join(f"{op} {path} ({self.reasons.get(op, '')})" for op, path in self.paths().items())

    def to_json(self) -> dict:
        k = self.kernels
        shapes = None if k.linear_shapes is None else sorted(list(case) for case in k.linear_shapes)
        return {"linear": k.linear.value, "experts": k.experts.value, "attention": k.attention.value,
                "linear_shapes": shapes, "reasons": dict(self.reasons), "more": dict(self.more)}

    @classmethod
    def from_json(cls, data: dict, check: CheckState = CheckState.CACHED) -> KernelVerdict:
        shapes = data["linear_shapes"]
        kernels = ExactKernels(KernelPath(data["linear"]), KernelPath(data["experts"]), KernelPath(data["attention"]),
                               None if shapes is None else frozenset(tuple(int(n) for n in case) for case in shapes))
        return cls(kernels, {str(k): str(v) for k, v in data["reasons"].items()},
                   more={str(k): str(v) for k, v in data["more"].items()}, check=check)


def by_construction(gemm: bool) -> KernelVerdict:
    """What exact mode runs before its check passed: per-row paths (or the invariant GEMM), each
    invariant on any machine; exact mode's prefix-cache hits refused."""
    if gemm and (unavailable := invariant_gemm.unavailable_reason()) is not None:
        raise RuntimeError(f"--exact-batching gemm: the invariant GEMM is unavailable here: {unavailable}")
    kernels = GEMM_KERNELS if gemm else ExactKernels()
    why = f"invariant GEMM, {invariant_gemm.isa()} kernel" if gemm else "one call per row until the check passes"
    return KernelVerdict(kernels, {"linear": why, "experts": why, "attention": "per-row SDPA until the check passes"})


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_linear(weights: Iterable[torch.Tensor], capacity: int, tokens: Iterable[int] = (1,)
                 ) -> tuple[frozenset[tuple[int, int, int]], str | None]:
    """The (out, in, tokens) cases where `rowwise_matmul` gives every row of every checked batch its
    `linear_rows` bits, and the first case that differed (None if none did)."""
    shapes = {}
    for w in weights:
        shapes.setdefault((tuple(w.shape), w.dtype, w.device), w)
    invariant, first_failure = set(), None
    for (shape, dtype, device), w in shapes.items():
        n_out, k = shape
        for t in tokens:
            batches = check_batch_sizes(capacity, n_out * k * t)
            if not batches:
                continue
            x = torch.randn(batches[-1], t, k, generator=_generator(n_out * 31 + k)).to(device, dtype)
            alone = linear_rows(x, w)  # [B, t, N]
            differs = next((b for b in batches if not torch.equal(rowwise_matmul(x[:b], w), alone[:b])), None)
            if differs is None:
                invariant.add((n_out, k, t))
            elif first_failure is None:
                first_failure = f"bmm differs from rows alone for a {n_out}x{k} weight, {t} token(s), batch {differs}"
    return frozenset(invariant), first_failure


def check_experts(modules: Iterable, capacity: int) -> str | None:
    """None if `_batched_experts` gives every token its alone-bits for each distinct experts shape."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

    seen = set()
    for module in modules:
        key = (tuple(module.gate_up_proj.shape), tuple(module.down_proj.shape), module.gate_up_proj.dtype)
        if key in seen:
            continue
        seen.add(key)
        hidden = module.gate_up_proj.shape[-1]
        base_name = getattr(module.config, "_omni_base_experts", None)
        eager = getattr(getattr(type(module), "forward", None), "__wrapped__", None)
        base = ALL_EXPERTS_FUNCTIONS.get_interface(base_name, eager)
        probe_input = torch.zeros(2, hidden, dtype=module.gate_up_proj.dtype, device=module.gate_up_proj.device)
        if base is not grouped_mm_experts_forward or not _batched_experts_cover(module, probe_input):
            return "this experts layout has no batched path"
        top_k = int(getattr(module.config, "num_experts_per_tok", 2))
        experts = module.num_experts
        batches = check_batch_sizes(capacity, 3 * hidden * module.down_proj.shape[-1] * top_k)
        if not batches:
            continue
        n = batches[-1]
        g = _generator(hidden + experts)
        states = torch.randn(n, hidden, generator=g).to(probe_input)
        index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(n)])
        weights = torch.rand(n, top_k, generator=g).to(probe_input)
        alone = experts_rows(base, module, states, index, weights)
        for b in batches:
            if not torch.equal(_batched_experts(module, states[:b], index[:b], weights[:b]), alone[:b]):
                return f"per-pair bmm differs from tokens alone for {experts} experts of width {hidden}, batch {b}"
    return None


def check_attention(shapes: Iterable[AttentionShape], capacity: int, dtype, device) -> str | None:
    """None if one SDPA over rows of equal length gives each row its alone-bits, for slices of a
    preallocated [capacity, kv_heads, positions, head_dim] buffer as the code predictor holds them."""
    import torch.nn.functional as F

    for s in shapes:
        batches = check_batch_sizes(capacity)
        if not batches:
            continue
        n = batches[-1]
        g = _generator(s.heads * 1000 + s.length)
        buffer = (n, s.kv_heads, max(s.positions, s.length + 1), s.head_dim)
        keys = torch.randn(*buffer, generator=g).to(device, dtype)[:, :, :s.length]
        values = torch.randn(*buffer, generator=g).to(device, dtype)[:, :, :s.length]
        query = torch.randn(n, s.tokens, s.heads, s.head_dim, generator=g).to(device, dtype).transpose(1, 2)
        kwargs = dict(scale=s.head_dim ** -0.5, is_causal=s.causal, enable_gqa=s.heads != s.kv_heads)
        alone = torch.cat([F.scaled_dot_product_attention(query[i:i + 1], keys[i:i + 1], values[i:i + 1], **kwargs)
                           for i in range(n)])
        for b in batches:
            if not torch.equal(F.scaled_dot_product_attention(query[:b], keys[:b], values[:b], **kwargs), alone[:b]):
                return (f"batched SDPA differs from rows alone at batch {b} ({s.heads}/{s.kv_heads} heads of "
                        f"{s.head_dim}, {s.tokens} query token(s) over {s.length})")
    return None


def _guarded(check, *args) -> str | None:
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001 - a check that cannot run means: not invariant here
        return f"check failed: {type(e).__name__}: {e}"


def check_exact_kernels(*, gemm: bool, capacity: int, linear_weights: list[torch.Tensor],
                        linear_tokens: tuple[int, ...] = (1,), experts: list | None = None,
                        attention: list[AttentionShape] | None = None, dtype=torch.float32,
                        device="cpu") -> KernelVerdict:
    """Which path each batched op of an engine takes here (nothing adopted: `exact_check` runs it).
    `gemm`: `--exact-batching gemm` (linear layers and experts through the invariant GEMM)."""
    with torch.inference_mode():  # parameters require grad outside it, and bmm's out= refuses them
        return _check(gemm, capacity, linear_weights, linear_tokens, experts, attention, dtype, device)


def _check(gemm, capacity, linear_weights, linear_tokens, experts, attention, dtype, device) -> KernelVerdict:
    started = time.perf_counter()
    linear_shapes: frozenset = frozenset()
    reasons: dict[str, str] = {}
    linear = experts_path = KernelPath.ROWS
    attention_path = KernelPath.ROWS
    cpu = torch.device(device).type == "cpu"
    if gemm:
        why = invariant_gemm.unavailable_reason()
        if why is not None:
            raise RuntimeError(f"--exact-batching gemm: the invariant GEMM is unavailable here: {why}")
        linear, experts_path = GEMM_KERNELS.linear, GEMM_KERNELS.experts
        reasons["linear"] = reasons["experts"] = f"invariant GEMM, {invariant_gemm.isa()} kernel"
    elif not cpu:
        reasons["linear"] = reasons["experts"] = "rows (no check off the CPU)"
    else:
        try:
            linear_shapes, why = check_linear(linear_weights, capacity, linear_tokens)
        except Exception as e:  # noqa: BLE001 - a check that cannot run means: not invariant here
            linear_shapes, why = frozenset(), f"check failed: {type(e).__name__}: {e}"
        cases = len({(*w.shape, t) for w in linear_weights for t in linear_tokens})
        linear = KernelPath.BATCHED if linear_shapes else KernelPath.ROWS
        reasons["linear"] = (f"bmm matched rows alone on {len(linear_shapes)} of {cases} cases"
                             + (f"; the rest row by row ({why})" if why else ""))
        if experts:
            why = _guarded(check_experts, experts, capacity)
            experts_path = KernelPath.ROWS if why else KernelPath.BATCHED
            reasons["experts"] = why or "per-pair bmm matched tokens alone"
        else:
            reasons["experts"] = "no MoE experts"
    if attention and cpu:
        why = _guarded(check_attention, attention, capacity, dtype, device)
        attention_path = KernelPath.ROWS if why else KernelPath.BATCHED
        reasons["attention"] = why or f"batched SDPA matched rows alone on {len(attention)} shapes"
    else:
        reasons["attention"] = "per-row SDPA over each row's slot"
    kernels = ExactKernels(linear, experts_path, attention_path, linear_shapes if linear is KernelPath.BATCHED
                           else frozenset())
    return KernelVerdict(kernels, reasons, time.perf_counter() - started)


def exact_check(stage: str, settings: CheckSettings, then: Callable[[KernelVerdict], None] | None = None,
                then_shapes: dict | None = None, **check) -> StartupCheck:
    """The check of an engine's batched kernels (`check_exact_kernels`; `then` adds the engine's
    other choices to the report, e.g. the thinker's prefix-cache hits, checked on `then_shapes`),
    keyed by every shape it runs. The engine calls `start()` and runs its model work inside
    `using_kernels(report.kernels)`."""
    def run() -> KernelVerdict:
        report = check_exact_kernels(**check)
        if then is not None:
            then(report)
        return report

    def weights(tensors) -> list:
        return sorted({(tuple(w.shape), str(w.dtype)) for w in tensors})

    experts = check.get("experts") or []
    shapes = {"gemm": check["gemm"], "capacity": check["capacity"], "linear": weights(check["linear_weights"]),
              "tokens": list(check.get("linear_tokens", (1,))),
              "experts": weights([m.gate_up_proj for m in experts] + [m.down_proj for m in experts]),
              "attention": [dataclasses.asdict(a) for a in check.get("attention") or []],
              "dtype": str(check.get("dtype", torch.float32)), "device": str(check.get("device", "cpu")),
              "gemm_kernel": invariant_gemm.isa() if check["gemm"] else None,
              "more": then_shapes}
    return StartupCheck(f"{stage} kernels", shapes, run, KernelVerdict.to_json, KernelVerdict.from_json, settings)


def log_report(report: KernelVerdict, check: StartupCheck) -> None:
    how = {CheckState.CACHED: "kept on disk", CheckState.FAILED: "check failed, unchanged"}.get(
        check.state, f"checked in {check.seconds:.2f} s")
    log.info("%s of exact batching on this CPU (%s, %d thread(s)), %s: %s", check.name,
             torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), how, report.line())


def linear_weights(*modules) -> list[torch.Tensor]:
    """The weights of every nn.Linear under these modules (what a batched decode step multiplies),
    and of the MoE routers, which call F.linear on a weight of their own."""
    return [m.weight for module in modules for m in module.modules()
            if isinstance(m, torch.nn.Linear) or (type(m).__name__.endswith("Router")
                                                  and getattr(getattr(m, "weight", None), "ndim", 0) == 2)]


def experts_modules(*modules) -> list:
    """The fused MoE experts under these modules (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    return [m for module in modules for m in module.modules()
            if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and hasattr(m, "num_experts")]
