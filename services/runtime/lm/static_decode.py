"""Static-shape decode steps for CUDA graphs: the LM decode step over KV slots, padded to a
batch bucket and replayed by a `GraphRunner`. Each LM's step function lives with its stage
(services/thinker/graphs.py, services/talker/graphs.py, with the code predictor's frame graph).

The engines' eager decode (services/runtime/lm/kernels.py) attends row by row over each row's own
slot length: shapes change every step, so it cannot be captured. Here the same module forward
runs with

- `StaticSlotView` as `past_key_values`: row i writes its new key/value at `positions[i]` of slot
  `slots[i]` (index tensors on the device) and attends over the first L positions of its slot,
  those up to positions[i] visible (a [B, 1, L] mask made on the device); padded rows write into
  a scratch slot that no request owns. L is the step's span: the smallest of `spans` (256, 512,
  ... up to `--max-model-len`) that holds the batch's longest row, so a graph is captured per
  (batch bucket, span) and a step reads about what its rows use, not `--max-model-len` positions
  a row. One SDPA for the batch with GQA and no copy of the keys (`kernels.span_attention`).

MoE layers use transformers' `grouped_mm` experts (its default; `histc`, no host sync). Prefill
(one request, variable length) stays eager, as in vLLM.

NOTE: exactness. The static step gives the same greedy tokens as the row-wise step on the tiny
checkpoint (tests/gpu/test_static_decode.py), but not bit-identical logits (masked SDPA over
the span vs SDPA over the row's length). Graphs are a GPU feature and exact batching is off on GPUs
by default (`--exact-batching auto`); on CPU nothing here runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from services.runtime.lm.cuda_graphs import GraphRunner, pad_rows, plan_padding
from services.runtime.lm.device_sampling import VARIANTS, Rows, SlotSampler, idle_params, mark_nonfinite
from services.runtime.lm.kernels import SlotSpan, batch_invariant
from services.runtime.lm.kv_slots import SlotKVCache
from services.runtime.model.device import to_device
from services.runtime.model.settings import GraphSettings

log = logging.getLogger(__name__)

POSITION_ROWS = 4  # text row + 3 multimodal rope rows (thinker and talker position ids)
MIN_SPAN = 256  # the shortest span a decode step attends over (positions of each row's slot)


def spans_for(max_len: int, shortest: int = MIN_SPAN) -> tuple[int, ...]:
    """The spans a step may attend over: `shortest`, doubling, up to `max_len` (always the last), so
    a step reads at most twice the positions its longest row uses (or `shortest`)."""
    spans, span = [], shortest
    while span < max_len:
        spans.append(span)
        span *= 2
    return (*spans, max_len)


class StaticSlotView:
    """`past_key_values` for one static decode step of B rows (one token each) over a SlotKVCache,
    attending over the first `span.shape[0]` positions of each row's slot."""

    def __init__(self, cache: SlotKVCache, slots: torch.Tensor, positions: torch.Tensor, span: torch.Tensor):
        self.cache = cache
        self.slots = slots  # [B] long, device: slot of each row
        self.positions = positions  # [B] long, device: cache position the new token goes to
        self.length = span.shape[0]  # span: [L] long, device, 0..L-1
        self.visible = (span[None, :] <= positions[:, None])[:, None]  # [B, 1, L]: row i sees 0..positions[i]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs=None):
        # key_states: [B, kv_heads, 1, head_dim] -> keys [B, kv_heads, L, head_dim]
        k_all, v_all = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        k_all[self.slots, :, self.positions] = key_states[:, :, 0]
        v_all[self.slots, :, self.positions] = value_states[:, :, 0]
        return (SlotSpan(k_all[:, :, :self.length].index_select(0, self.slots), self.visible),
                SlotSpan(v_all[:, :, :self.length].index_select(0, self.slots), self.visible))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # unused: position ids are always passed explicitly


class SlotDecodeGraphs:
    """The engine's hook: one LM decode step, padded to a bucket and replayed from a graph.

    With a `sampler` (device sampling), a step given its rows' settings (`Rows`) draws its tokens
    inside the graph too: the step's first output, the logits [B, vocab], becomes the ids [B] and
    their host view (`mark_nonfinite`), the penalty history updated in place; a graph per
    (bucket, span, sampler variant), the greedy one captured at start-up, the others when first
    asked for. `then(ids, *other outputs, *more, variant=)` carries the graph on from the drawn ids
    (the talker's code predictor frame: one graph a talker step), its outputs after the host view;
    `more`: inputs of its own, [8, B] sampler settings each (the predictor's residual draws).

    `decode` returns None when it does not handle the batch (graphs off or failed, batch above
    the largest bucket): the engine then runs its own eager step."""

    def __init__(self, step: Callable, cache: SlotKVCache, scratch_slot: int, settings: GraphSettings,
                 exact: bool, name: str, device, shortest_span: int = MIN_SPAN, sampler: SlotSampler | None = None,
                 then: Callable | None = None):
        if not 0 <= scratch_slot < len(cache.lengths):
            raise ValueError("the cache needs a scratch slot for padded rows")
        self.step = step
        self.cache = cache
        self.scratch_slot = scratch_slot  # owned by no request: padded rows write here
        self.settings = settings
        self.exact = exact
        self.device = device
        self.spans = spans_for(cache.max_len, shortest_span)
        # Each span's positions 0..L-1 on the device, made once: a step's input whose shape is its span.
        self.span_ids = {span: torch.arange(span, device=device) for span in self.spans}
        self.sampler = sampler
        self.then = then
        # A padded row's sampler settings (drawing into the scratch slot's history), made once.
        self._idle = None if sampler is None else torch.tensor(
            idle_params(scratch_slot), dtype=torch.float64, device=device)[:, None]
        self._variant = VARIANTS[0]  # the sampler's op set of the step being run (or captured)
        variants = len(VARIANTS) if sampler is not None else 1
        # A graph per (bucket, span, variant): 7 x 5 x 3 at --max-model-len 4096 (9 spans at 65536).
        self.runner = GraphRunner(self._run, settings.enabled, name,
                                  max_graphs=len(settings.buckets) * len(self.spans) * variants)

    def _run(self, x, position_ids, slots, positions, span, *params):
        with batch_invariant(self.exact):
            out = self.step(x, position_ids, slots, positions, span)
            if not params:
                return out
            logits, *rest = out if isinstance(out, tuple) else (out,)
            ids = self.sampler.sample(logits, Rows.captured(params[0], self._variant))
            marked = mark_nonfinite(ids, logits)
            if self.then is not None:
                return (marked, *self.then(ids, *rest, *params[1:], variant=self._variant))
            return (ids, marked, *rest)

    @torch.inference_mode()
    def capture_all(self, example_row: torch.Tensor) -> None:
        """Capture every (bucket, span) at start-up, the greedy variant where the graphs draw (the
        others when first used). example_row: one row of the step's first input
        ([1, 1] ids or [1, 1, H] embeddings). Every row writes only to the scratch slot."""
        for bucket in self.settings.buckets:
            x = example_row.to(self.device).expand(bucket, *example_row.shape[1:]).contiguous()
            position_ids = torch.zeros((POSITION_ROWS, bucket, 1), dtype=torch.long, device=self.device)
            slots = torch.full((bucket,), self.scratch_slot, dtype=torch.long, device=self.device)
            positions = torch.zeros((bucket,), dtype=torch.long, device=self.device)
            params = self._idle_params(bucket)
            if any(self.runner.capture((bucket, span, self._variant), x, position_ids, slots, positions,
                                       self.span_ids[span], *params) is None
                   for span in self.spans):  # stops at the first that fails (the runner is then eager)
                break
        log.info("%s", self.runner.summary())

    def _idle_params(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The sampler's input for `bucket` rows that draw nothing read (none without a sampler)."""
        return () if self._idle is None else (self._idle.expand(-1, bucket).contiguous(),)

    def decode(self, x: torch.Tensor, position_ids: torch.Tensor, slots: list[int], rows: Rows | None = None,
               more: tuple[torch.Tensor, ...] = ()):
        """x: [B, 1] ids or [B, 1, H] embeddings; position_ids [4, B, 1]; `rows`: the rows' sampling
        settings, with which the graph draws (a sampler given); `more`: `then`'s own inputs. Returns
        the step's outputs for the B real rows (a tuple; drawn: ids and their host view, then the
        step's other outputs, or their host view and what `then` made), with the new token committed
        to every slot."""
        if not self.runner.enabled or self.runner.plan(len(slots), self.settings.buckets) is None:
            return None
        return self.run_padded(x, position_ids, slots, rows, more)

    def run_padded(self, x: torch.Tensor, position_ids: torch.Tensor, slots: list[int], rows: Rows | None = None,
                   more: tuple[torch.Tensor, ...] = ()):
        """`decode` without the checks: through the runner, eagerly when it is disabled (CPU tests)."""
        plan = plan_padding(len(slots), self.settings.buckets)
        starts = [self.cache.lengths[s] for s in slots]
        for slot, start in zip(slots, starts):
            if start + 1 > self.cache.max_len:
                raise ValueError(f"slot {slot} is full ({self.cache.max_len} tokens)")
        span = next(span for span in self.spans if span > max(starts))
        # One upload, queued without waiting (pinned on cuda): each row's slot and cache position.
        slot_ids, cache_pos = to_device([slots + [self.scratch_slot] * plan.pad, starts + [0] * plan.pad],
                                        torch.long, self.device)
        params = ()
        if (rows is None) != (self.sampler is None):
            raise ValueError("a step's rows are given exactly where the graphs draw (a sampler)")
        if rows is not None:
            self._variant = rows.variant
            params = tuple(pad_rows(p, plan, dim=1, fill=self._idle) for p in (rows.params, *more))
        try:
            outputs = self.runner((plan.bucket, span, self._variant), pad_rows(x, plan),
                                  pad_rows(position_ids, plan, dim=1), slot_ids, cache_pos, self.span_ids[span],
                                  *params)
        finally:
            self._variant = VARIANTS[0]
        for slot, start in zip(slots, starts):
            self.cache.lengths[slot] = start + 1
        return tuple(o[:plan.batch] for o in outputs)
