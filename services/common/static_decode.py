"""Static-shape decode steps for CUDA graphs: the LM decode step over KV slots, and the talker's
code predictor frame, each padded to a batch bucket and replayed by a `GraphRunner`.

The engines' eager decode (services/common/batching.py) attends row by row over each row's own
slot length: shapes change every step, so it cannot be captured. Here the same module forward
runs with

- `StaticSlotView` as `past_key_values`: row i writes its new key/value at `positions[i]` of slot
  `slots[i]` (index tensors on the device) and attends over the whole slot, `max_len` positions,
  under a [B, 1, 1, max_len] mask (position <= positions[i]); padded rows write into a scratch
  slot that no request owns. Attention cost is O(max_len) per row: keep `--max-model-len` tight.
- `UniformView` for the code predictor: every row of a frame starts a fresh 17-position cache and
  advances in lockstep, so the 15 sub-steps unroll into one graph with static slices; greedy picks
  (argmax) happen inside the graph. Frames with a sampling request run eagerly.

MoE layers use transformers' `grouped_mm` experts (its default; `histc`, no host sync). Prefill
(one request, variable length) stays eager, as in vLLM.

NOTE: exactness. The static step gives the same greedy tokens as the row-wise step on the tiny
checkpoint (tests/gpu/test_static_decode.py), but not bit-identical logits (masked SDPA over
max_len vs SDPA over the row's length). Graphs are a GPU feature and exact batching is off on GPUs
by default (`--exact-batching auto`); on CPU nothing here runs.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from services.common.batching import SlotKVCache, batch_invariant
from services.common.cuda_graphs import GraphRunner, GraphSettings, pad_rows, plan_padding

log = logging.getLogger(__name__)

POSITION_ROWS = 4  # text row + 3 multimodal rope rows (thinker and talker position ids)


class StaticSlotView:
    """`past_key_values` for one static decode step of B rows (one token each) over a SlotKVCache."""

    def __init__(self, cache: SlotKVCache, slots: torch.Tensor, positions: torch.Tensor):
        self.cache = cache
        self.slots = slots  # [B] long, device: slot of each row
        self.positions = positions  # [B] long, device: cache position the new token goes to

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs=None):
        # key_states: [B, kv_heads, 1, head_dim] -> keys [B, kv_heads, max_len, head_dim]
        k_all, v_all = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        k_all[self.slots, :, self.positions] = key_states[:, :, 0]
        v_all[self.slots, :, self.positions] = value_states[:, :, 0]
        return k_all.index_select(0, self.slots), v_all.index_select(0, self.slots)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # unused: position ids are always passed explicitly

    def mask(self) -> torch.Tensor:
        """[B, 1, 1, max_len] bool: row i sees cache positions 0..positions[i]."""
        span = torch.arange(self.cache.max_len, device=self.positions.device)
        return (span[None, :] <= self.positions[:, None])[:, None, None, :]


class UniformView:
    """`past_key_values` for a batch whose rows all sit at the same position (code predictor)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], batch: int):
        self.keys = [k[:batch] for k in keys]  # per layer [B, kv_heads, positions, head_dim]
        self.values = [v[:batch] for v in values]
        self.length = 0  # positions written

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs=None):
        end = self.length + key_states.shape[2]
        self.keys[layer_idx][:, :, self.length:end] = key_states
        self.values[layer_idx][:, :, self.length:end] = value_states
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def commit(self, tokens: int) -> None:
        self.length += tokens


def thinker_step(model, cache: SlotKVCache) -> Callable:
    """(ids [B, 1], position_ids [4, B, 1], slots [B], positions [B]) -> logits [B, vocab]."""

    def step(ids, position_ids, slots, positions):
        view = StaticSlotView(cache, slots, positions)
        out = model(input_ids=ids, position_ids=position_ids, attention_mask=view.mask(), past_key_values=view,
                    use_cache=True)
        return out.logits[:, -1]

    return step


def talker_step(model, cache: SlotKVCache) -> Callable:
    """(embeds [B, 1, H], position_ids [4, B, 1], slots [B], positions [B])
    -> (logits [B, vocab], last hidden [B, 1, H])."""

    def step(embeds, position_ids, slots, positions):
        view = StaticSlotView(cache, slots, positions)
        out = model(inputs_embeds=embeds, position_ids=position_ids, attention_mask=view.mask(),
                    past_key_values=view, use_cache=True, output_hidden_states=True, generation_step=0)
        return out.logits[:, -1], out.hidden_states[0][-1][:, -1:]

    return step


class SlotDecodeGraphs:
    """The engine's hook: one LM decode step, padded to a bucket and replayed from a graph.

    `decode` returns None when it does not handle the batch (graphs off or failed, batch above
    the largest bucket): the engine then runs its own eager step."""

    def __init__(self, step: Callable, cache: SlotKVCache, scratch_slot: int, settings: GraphSettings,
                 exact: bool, name: str, device):
        if not 0 <= scratch_slot < len(cache.lengths):
            raise ValueError("the cache needs a scratch slot for padded rows")
        self.step = step
        self.cache = cache
        self.scratch_slot = scratch_slot  # owned by no request: padded rows write here
        self.settings = settings
        self.exact = exact
        self.device = device
        self.runner = GraphRunner(self._run, settings.enabled, name)

    def _run(self, x, position_ids, slots, positions):
        with batch_invariant(self.exact):
            return self.step(x, position_ids, slots, positions)

    @torch.inference_mode()
    def capture_all(self, example_row: torch.Tensor) -> None:
        """Capture every bucket at start-up. example_row: one row of the step's first input
        ([1, 1] ids or [1, 1, H] embeddings). Every row writes only to the scratch slot."""
        for bucket in self.settings.buckets:
            x = example_row.to(self.device).expand(bucket, *example_row.shape[1:]).contiguous()
            position_ids = torch.zeros((POSITION_ROWS, bucket, 1), dtype=torch.long, device=self.device)
            slots = torch.full((bucket,), self.scratch_slot, dtype=torch.long, device=self.device)
            positions = torch.zeros((bucket,), dtype=torch.long, device=self.device)
            if self.runner.capture((bucket, POSITION_ROWS), x, position_ids, slots, positions) is None:
                break
        log.info("%s", self.runner.summary())

    def decode(self, x: torch.Tensor, position_ids: torch.Tensor, slots: list[int]):
        """x: [B, 1] ids or [B, 1, H] embeddings; position_ids [4, B, 1]. Returns the step's
        outputs for the B real rows (a tuple), with the new token committed to every slot."""
        if not self.runner.enabled or plan_padding(len(slots), self.settings.buckets) is None:
            return None
        return self.run_padded(x, position_ids, slots)

    def run_padded(self, x: torch.Tensor, position_ids: torch.Tensor, slots: list[int]):
        """`decode` without the checks: through the runner, eagerly when it is disabled (CPU tests)."""
        plan = plan_padding(len(slots), self.settings.buckets)
        starts = [self.cache.lengths[s] for s in slots]
        for slot, start in zip(slots, starts):
            if start + 1 > self.cache.max_len:
                raise ValueError(f"slot {slot} is full ({self.cache.max_len} tokens)")
        slot_ids = torch.tensor(slots + [self.scratch_slot] * plan.pad, dtype=torch.long).to(self.device)
        cache_pos = torch.tensor(starts + [0] * plan.pad, dtype=torch.long).to(self.device)
        outputs = self.runner((plan.bucket, position_ids.shape[0]), pad_rows(x, plan), pad_rows(position_ids, plan, dim=1),
                              slot_ids, cache_pos)
        for slot, start in zip(slots, starts):
            self.cache.lengths[slot] = start + 1
        return tuple(o[:plan.batch] for o in outputs)


class PredictorGraphs:
    """The talker's code predictor, one whole frame (prefill + 14 steps, greedy) per graph replay."""

    def __init__(self, talker, settings: GraphSettings, exact: bool, device, dtype):
        self.talker = talker
        self.predictor = talker.code_predictor
        self.num_groups = int(talker.config.num_code_groups)
        self.settings = settings
        self.exact = exact
        self.device = device
        config = self.predictor.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # Allocated once: [max bucket, kv_heads, 1 + num_groups, head_dim] per layer (1 hidden +
        # 16 codes; the last code is never fed back, so 16 positions are written).
        shape = (max(settings.buckets), config.num_key_value_heads, self.num_groups + 1, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.runner = GraphRunner(self._frame, settings.enabled, "code predictor")

    def _frame(self, past_hidden: torch.Tensor, codes0: torch.Tensor):
        # past_hidden [B, 1, H] talker hidden; codes0 [B, 1] layer-0 codes
        # -> (codes [B, num_groups] long, sum of the codes' embeddings [B, 1, H])
        embeddings = self.predictor.get_input_embeddings()  # num_groups - 1 tables
        first = self.talker.get_input_embeddings()(codes0)  # [B, 1, H]
        view = UniformView(self.keys, self.values, codes0.shape[0])
        columns, hiddens = [codes0[:, 0]], [first]
        with batch_invariant(self.exact):
            out = self.predictor(inputs_embeds=torch.cat((past_hidden, first), dim=1), past_key_values=view,
                                 use_cache=True)
            view.commit(2)
            for step in range(1, self.num_groups):
                ids = torch.argmax(out.logits[:, -1], dim=-1, keepdim=True)  # [B, 1]
                columns.append(ids[:, 0])
                hiddens.append(embeddings[step - 1](ids))
                if step < self.num_groups - 1:
                    out = self.predictor(input_ids=ids, past_key_values=view, use_cache=True, generation_steps=step)
                    view.commit(1)
        return torch.stack(columns, dim=1), torch.cat(hiddens, dim=1).sum(1, keepdim=True)

    @torch.inference_mode()
    def capture_all(self, hidden_size: int, dtype) -> None:
        for bucket in self.settings.buckets:
            hidden = torch.zeros((bucket, 1, hidden_size), dtype=dtype, device=self.device)
            codes0 = torch.zeros((bucket, 1), dtype=torch.long, device=self.device)
            if self.runner.capture(bucket, hidden, codes0) is None:
                break
        log.info("%s", self.runner.summary())

    def predict(self, past_hidden: torch.Tensor, codes0: torch.Tensor):
        """past_hidden [B, 1, H], codes0 [B, 1] -> (codes [B, num_groups] long, embeds [B, 1, H]),
        or None when not handled (graphs off or failed, batch above the largest bucket)."""
        if not self.runner.enabled or plan_padding(codes0.shape[0], self.settings.buckets) is None:
            return None
        return self.run_padded(past_hidden, codes0)

    def run_padded(self, past_hidden: torch.Tensor, codes0: torch.Tensor):
        """`predict` without the checks: through the runner, eagerly when it is disabled (CPU tests)."""
        plan = plan_padding(codes0.shape[0], self.settings.buckets)
        codes, embeds = self.runner(plan.bucket, pad_rows(past_hidden, plan), pad_rows(codes0, plan))
        return codes[:plan.batch], embeds[:plan.batch]
