"""The talker's static-shape steps for CUDA graphs: its LM decode step over KV slots and one
whole code-predictor frame (prefill + 14 sub-steps) per replay.

Every row of a frame starts a fresh 17-position cache and advances in lockstep (the lean loop of
services/talker/code_predictor.py, its own buffers; fused where exact batching is off), so the 15
sub-steps unroll into one graph with static slices. With device sampling the decode step's graph
draws the layer-0 codes and goes on to the frame (`frame_after`): one replay a decode step, sampled
residuals drawn inside it too. `PredictorGraphs` replays a greedy frame alone: the first frame of
the rows a prefill starts (host sampling: every frame; sampled rows then run eagerly). See
services/runtime/lm/static_decode.py for the slot view and the exactness note.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from services.runtime.lm.cuda_graphs import GraphRunner, pad_rows, plan_padding
from services.runtime.lm.device_sampling import VARIANTS, Rows, SlotSampler
from services.runtime.lm.kv_slots import SlotKVCache
from services.runtime.lm.static_decode import StaticSlotView
from services.runtime.model.settings import GraphSettings
from services.talker.code_predictor import CodePredictor

log = logging.getLogger(__name__)


def talker_step(model, cache: SlotKVCache) -> Callable:
    """(embeds [B, 1, H], position_ids [4, B, 1], slots [B], positions [B], span [L])
    -> (logits [B, vocab], last hidden [B, 1, H])."""

    def step(embeds, position_ids, slots, positions, span):
        view = StaticSlotView(cache, slots, positions, span)
        out = model(inputs_embeds=embeds, position_ids=position_ids, past_key_values=view, use_cache=True,
                    output_hidden_states=True, generation_step=0)
        return out.logits[:, -1], out.hidden_states[0][-1][:, -1:]

    return step


def frame_after(graphs: PredictorGraphs, residual_sampler: SlotSampler) -> Callable:
    """The end of the talker's decode graph (static_decode.SlotDecodeGraphs' `then`): from the drawn
    layer-0 codes [B] and the last hidden state [B, 1, H], the frame's residual codes, greedy in the
    greedy variant, else drawn as `TalkerEngine._residual_picks` draws them (their [8, B] settings one
    more input; group g of frame f with counter 16 f + g). -> (codes [B, groups], embeds [B, 1, H])."""

    def then(codes0, hidden, *residual, variant: str):
        if variant == VARIANTS[0]:
            pick = _argmax
        else:
            rows, groups = Rows.captured(residual[0], VARIANTS[-1]), iter(range(1, graphs.num_groups))
            pick = lambda logits: residual_sampler.sample(  # noqa: E731
                logits, rows, remember=False, counter_offset=next(groups))
        codes, embeds = graphs.frame(hidden, codes0[:, None], pick, graphs.exact)
        return codes.to(torch.int64), embeds

    return then


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)


class PredictorGraphs:
    """The talker's code predictor, one whole frame (prefill + 14 steps, greedy) per graph replay."""

    def __init__(self, talker, settings: GraphSettings, exact: bool, device, dtype):
        self.talker = talker
        self.predictor = talker.code_predictor
        self.num_groups = int(talker.config.num_code_groups)
        self.settings = settings
        self.exact = exact
        self.device = device
        # Keys and values allocated once: [max bucket, kv_heads, 1 + num_groups, head_dim] per layer.
        self.frame = CodePredictor(talker, max(settings.buckets), device, dtype, batched_attention=True,
                                   fused=not exact)
        self.keys, self.values = self.frame.keys, self.frame.values
        self.runner = GraphRunner(self._frame, settings.enabled, "code predictor")

    def _frame(self, past_hidden: torch.Tensor, codes0: torch.Tensor):
        # past_hidden [B, 1, H] talker hidden; codes0 [B, 1] layer-0 codes
        # -> (codes [B, num_groups] long, sum of the codes' embeddings [B, 1, H])
        return self.frame(past_hidden, codes0, lambda logits: torch.argmax(logits, dim=-1), self.exact)

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
        if not self.runner.enabled or self.runner.plan(codes0.shape[0], self.settings.buckets) is None:
            return None
        return self.run_padded(past_hidden, codes0)

    def run_padded(self, past_hidden: torch.Tensor, codes0: torch.Tensor):
        """`predict` without the checks: through the runner, eagerly when it is disabled (CPU tests)."""
        plan = plan_padding(codes0.shape[0], self.settings.buckets)
        codes, embeds = self.runner(plan.bucket, pad_rows(past_hidden, plan), pad_rows(codes0, plan))
        return codes[:plan.batch], embeds[:plan.batch]
