"""CUDA graphs: capture a static-shape step once per batch-size bucket, replay it in the engine loop.

A decode step of a small batch is mostly kernel-launch overhead on a GPU (the talker's 15 code
predictor sub-steps per frame, the code2wav chunk windows): replaying a captured graph launches
the whole step at once. A graph fixes every shape and address, so

- batches are padded up to the smallest configured bucket that holds them (`plan_padding`);
  a batch above the largest bucket runs eagerly;
- each captured callable reads its inputs from static buffers that `GraphRunner` copies the
  real inputs into, and its outputs are copied out after the replay;
- any cache the step writes (KV slots) must be allocated once, before capture.

Off on CPU (`--cuda-graphs auto` = on for cuda only): there `GraphRunner` calls the function
directly, so CPU behaviour is unchanged.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.base.errors import UserError

if TYPE_CHECKING:  # torch is imported where used: importing this module stays cheap
    import torch

log = logging.getLogger(__name__)


def pick_bucket(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= batch; None above the largest (run eagerly)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return next((b for b in sorted(buckets) if b >= batch), None)


@dataclass(frozen=True)
class PaddingPlan:
    batch: int  # real rows, first in the padded batch
    bucket: int  # rows the captured graph runs

    @property
    def pad(self) -> int:
        return self.bucket - self.batch


def plan_padding(batch: int, buckets: tuple[int, ...]) -> PaddingPlan | None:
    bucket = pick_bucket(batch, buckets)
    return None if bucket is None else PaddingPlan(batch, bucket)


def pad_rows(x: torch.Tensor, plan: PaddingPlan, dim: int = 0, fill: torch.Tensor | None = None) -> torch.Tensor:
    """Pad `x` along `dim` from plan.batch to plan.bucket rows: copies of `fill` (one row, the
    size of x's rows) or, by default, of row 0, so padded rows hold valid ids and finite values."""
    import torch

    if x.shape[dim] != plan.batch:
        raise ValueError(f"expected {plan.batch} rows along dim {dim}, got {x.shape[dim]}")
    if plan.pad == 0:
        return x
    row = x.narrow(dim, 0, 1) if fill is None else fill.reshape(x.narrow(dim, 0, 1).shape).to(x)
    reps = [1] * x.ndim
    reps[dim] = plan.pad
    return torch.cat((x, row.repeat(*reps)), dim=dim)


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


@dataclass
class _Captured:
    graph: object  # torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # static buffers the graph reads
    outputs: tuple[torch.Tensor, ...]  # static buffers the graph writes


@dataclass
class GraphStats:
    captures: int = 0
    capture_s: float = 0.0  # wall time spent capturing (warm-up runs included)
    replays: int = 0
    eager_calls: int = 0
    failed: str | None = None  # why capture was given up (first error), if it was
    said_above: bool = False  # a batch above the largest bucket was logged (once)
    keys: list = field(default_factory=list)  # captured keys, in capture order


class GraphRunner:
    """Runs `fn(*inputs) -> Tensor | tuple[Tensor, ...]`, from a CUDA graph captured per `key`.

    The key names the static shapes (e.g. (window length, bucket)); the inputs of one key must
    always have the same shapes and dtypes. Disabled (CPU, or --cuda-graphs off): calls `fn`.
    `fn` must be capturable: no host syncs (.item(), .tolist(), nonzero), no tensors created
    from host data, and every buffer it writes outside its outputs allocated before capture.

    NOTE: memory. All graphs of a runner share one memory pool: each replay's outputs are copied
    out before anything else runs, so a later graph reusing an earlier one's memory is harmless
    (replays are sequential, on the engine thread). If a capture fails, the error is logged and
    the runner stays eager from then on (a serving process must not die of an optimisation).
    """

    def __init__(self, fn: Callable, enabled: bool, name: str = "graph", max_graphs: int = 64, warmup: int = 2):
        import torch

        if enabled and not torch.cuda.is_available():
            raise UserError(f"{name}: CUDA graphs need a CUDA device")
        self.fn = fn
        self.enabled = enabled
        self.name = name
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.stats = GraphStats()
        self._graphs: dict[Hashable, _Captured] = {}  # key -> captured graph
        self._pool = None

    def has(self, key: Hashable) -> bool:
        return key in self._graphs

    def plan(self, batch: int, buckets: tuple[int, ...]) -> PaddingPlan | None:
        """`plan_padding`, the first batch above the largest bucket logged (it runs eagerly, batched)."""
        plan = plan_padding(batch, buckets)
        if plan is None and not self.stats.said_above:
            self.stats.said_above = True
            log.warning("%s: a batch of %d is above the largest CUDA graph bucket (%d): such batches run eagerly, "
                        "batched (logged once)", self.name, batch, max(buckets))
        return plan

    def __call__(self, key: Hashable, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        entry = self._graphs.get(key) if self.enabled else None
        if entry is None and self.enabled and len(self._graphs) < self.max_graphs:
            entry = self.capture(key, *inputs)
        if entry is None:
            self.stats.eager_calls += 1
            return _as_tuple(self.fn(*inputs))
        for static, x in zip(entry.inputs, inputs):
            if static.shape != x.shape:
                raise ValueError(f"{self.name}{key}: input shape {tuple(x.shape)} != captured {tuple(static.shape)}")
            static.copy_(x, non_blocking=True)
        entry.graph.replay()
        self.stats.replays += 1
        return tuple(o.clone() for o in entry.outputs)

    def capture(self, key: Hashable, *example_inputs: torch.Tensor) -> _Captured | None:
        """Warm up on a side stream, then capture `fn` on static copies of the inputs.
        Returns None (and turns the runner eager) if capture fails."""
        import torch

        if not self.enabled:
            return None
        if key in self._graphs:
            return self._graphs[key]
        started = time.perf_counter()
        try:
            static = tuple(x.detach().clone() for x in example_inputs)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(self.warmup):  # lazy inits, cuBLAS workspaces, autotuning
                    self.fn(*static)
            torch.cuda.current_stream().wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = _as_tuple(self.fn(*static))
        except Exception as exc:  # noqa: BLE001 - any capture error: serve eagerly
            where = traceback.extract_tb(exc.__traceback__)[-1]  # the op that broke capture
            self.stats.failed = f"{key}: {type(exc).__name__}: {exc} (at {where.filename}:{where.lineno} {where.name})"
            log.warning("%s: CUDA graph capture failed, running eagerly from now on (%s)", self.name, self.stats.failed)
            self.enabled = False
            self._graphs.clear()
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - already reported above
                pass
            return None
        entry = _Captured(graph, static, outputs)
        self._graphs[key] = entry
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - started
        self.stats.keys.append(key)
        return entry

    def summary(self) -> str:
        s = self.stats
        if s.failed:
            return f"{self.name}: CUDA graph capture failed, eager ({s.failed})"
        return f"{self.name}: {s.captures} CUDA graphs captured in {s.capture_s:.1f} s"
