"""Exact streaming vocoding for any window: the pre-transformer runs incrementally with a KV cache,
only the convolution stack is re-run over a short left context.

NOTE: why. `StreamingDecoder` re-decodes `left_context` frames before every chunk; that is exact
only while the context covers the vocoder's whole reach back: the transformer's
layers x (window - 1) frames plus the convolutions' ~10 frames. The tiny checkpoint (2 layers,
window 8) is covered by 25 frames; the real layout (8 layers, window 72) reaches ~580 frames back,
and with 25 frames of context the SNR against one forward is 3-4 dB (docs/qwen3-omni.md, section
"The vocoder"; figures in section "Float32 and float64").
Here the pre-transformer keeps its KV cache across chunks (its sliding window bounds the cache),
so its outputs for new frames are those of one forward over everything; the convolution stack,
which has no cache, is re-run over the last `conv_context` transformer frames plus the new ones.
Sample bookkeeping is StreamingDecoder's: a window starting at frame a yields global samples
[a*U, (a+n)*U - L); the last L samples of each chunk are held back by construction (the next
window regenerates them).
"""

from __future__ import annotations

import numpy as np
import torch

from services.code2wav.streaming import EMPTY, VocoderGeometry

# The convolutions (upsampling ConvNeXt blocks + decoder residual units) reach about 10.1 frames
# back (docs/qwen3-omni.md, section "The vocoder"); 12 leaves a margin.
DEFAULT_CONV_CONTEXT = 12


class IncrementalDecoder:
    """Per-request state: the pre-transformer's KV cache and its last `conv_context` outputs."""

    def __init__(self, model, geometry: VocoderGeometry, conv_context: int = DEFAULT_CONV_CONTEXT):
        from transformers import DynamicCache

        if conv_context < geometry.min_left_context:
            raise ValueError(f"conv_context must be at least {geometry.min_left_context} frame(s)")
        self.model = model
        self.geometry = geometry
        self.conv_context = conv_context
        self.num_quantizers = int(model.config.num_quantizers)
        self._cache = DynamicCache(config=model.pre_transformer.config)
        device = next(model.parameters()).device
        # [<= conv_context, H] transformer outputs before the next chunk, in the model dtype.
        self._hidden = torch.zeros((0, model.config.hidden_size), device=device,
                                   dtype=next(model.parameters()).dtype)
        self._frames_seen = 0
        self._samples_emitted = 0

    @property
    def frames_seen(self) -> int:
        return self._frames_seen

    @property
    def samples_emitted(self) -> int:
        return self._samples_emitted

    @torch.inference_mode()
    def push(self, frames: torch.Tensor) -> np.ndarray:
        """frames [n, Q] int64 -> the float32 samples that are now final."""
        if frames.dim() != 2 or frames.shape[1] != self.num_quantizers:
            raise ValueError(f"expected frames [n, {self.num_quantizers}], got {list(frames.shape)}")
        n = frames.shape[0]
        if n == 0:
            return EMPTY.copy()
        model = self.model
        codes = frames.to(device=self._hidden.device, dtype=torch.long).t().unsqueeze(0)  # [1, Q, n]
        embedded = model.code_embedding(codes + model.code_offset).mean(1)  # [1, n, H]
        new = model.pre_transformer(inputs_embeds=embedded, past_key_values=self._cache,
                                    use_cache=True).last_hidden_state[0]  # [n, H]
        window = torch.cat([self._hidden, new])  # [c + n, H]
        window_start = self._frames_seen - self._hidden.shape[0]
        wav = self._convolve(window)  # global samples [window_start*U, (frames_seen + n)*U - L)
        U, L = self.geometry.samples_per_frame, self.geometry.lookahead_samples
        out = wav[self._samples_emitted - window_start * U:]
        self._hidden = window[max(0, window.shape[0] - self.conv_context):].clone()
        self._frames_seen += n
        self._samples_emitted += out.shape[-1]
        assert self._samples_emitted == self._frames_seen * U - L, "vocoder output length drifted"
        return out.float().cpu().numpy()

    def finish(self) -> np.ndarray:
        """The forward already trims the samples that need later frames: nothing is pending."""
        return EMPTY.copy()

    def _convolve(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [m, H] -> samples [m*U - L]: Qwen3OmniMoeCode2Wav.forward after its pre-transformer.
        x = hidden.t().unsqueeze(0)  # [1, H, m]
        for blocks in self.model.upsample:
            for block in blocks:
                x = block(x)
        for block in self.model.decoder:
            x = block(x)
        return x.clamp(min=-1, max=1)[0, 0]
