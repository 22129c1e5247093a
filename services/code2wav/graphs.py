"""CUDA graphs for the window engine (engine.py, `WindowCode2WavEngine`): vocoder forwards of
[B, n, Q] windows, replayed from a graph captured per (window length, batch bucket).

Window lengths are few (first chunk, first + context, context + chunk, and the tails), so the
talker's default chunks' windows are captured at start-up (`Code2WavConfig.graph_windows`) and
any other length on first use. The incremental decoder captures its own calls (incremental.py:
per (block shape, bucket), its requests' state in slots on the device that the graphs read).
"""

from __future__ import annotations

import logging

import torch

from services.base.stages import Stage
from services.code2wav.vocoder import forward_batch
from services.runtime.lm.cuda_graphs import GraphRunner, pad_rows, plan_padding
from services.runtime.model.settings import GraphSettings

log = logging.getLogger(__name__)


class Code2WavGraphs:
    """Vocoder forwards of [B, n, Q] windows, replayed from a graph per (n, bucket)."""

    def __init__(self, model, settings: GraphSettings, max_graphs: int = 96):
        self.model = model
        self.settings = settings
        self.device = next(model.parameters()).device
        self.runner = GraphRunner(self._forward, settings.enabled, Stage.CODE2WAV, max_graphs=max_graphs)

    def _forward(self, codes: torch.Tensor) -> torch.Tensor:
        # codes [B, Q, n] long on the device -> wav [B, n*U - L] float32
        return self.model(codes)[:, 0].float()

    @torch.inference_mode()
    def capture(self, window_lengths: tuple[int, ...], num_quantizers: int) -> None:
        """Capture every (window length, bucket) at start-up; others are captured on first use."""
        for n in window_lengths:
            for bucket in self.settings.buckets:
                codes = torch.zeros((bucket, num_quantizers, n), dtype=torch.long, device=self.device)
                if self.runner.capture((n, bucket), codes) is None:
                    break
        log.info("%s (windows %s; other lengths on first use)", self.runner.summary(), list(window_lengths))

    @torch.inference_mode()
    def decode(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [G, n, Q] -> wav [G, n*U - L] float32 (eagerly above the largest bucket)."""
        plan = plan_padding(windows.shape[0], self.settings.buckets)
        if plan is None or not self.runner.enabled:
            return forward_batch(self.model, windows)
        codes = windows.to(device=self.device, dtype=torch.long).transpose(1, 2)  # [G, Q, n]
        zeros = torch.zeros_like(codes[:1])  # padded rows decode silence codes
        (wav,) = self.runner((codes.shape[2], plan.bucket), pad_rows(codes, plan, fill=zeros))
        return wav[:plan.batch]
