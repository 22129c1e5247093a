"""Exact streaming vocoding for any window and any chunk: every layer of the vocoder keeps the
state it needs across chunks, so each frame is decoded exactly once.

NOTE: why. `WindowDecoder` (window.py) re-decodes `left_context` frames before every chunk; that is exact
only while the context covers the vocoder's whole reach back: the transformer's
layers x (window - 1) frames plus the convolutions' ~10 frames. The tiny checkpoint (2 layers,
window 8) is covered by 25 frames; the real layout (8 layers, window 72) reaches ~580 frames back,
and with 25 frames of context the SNR against one forward is 3-4 dB (docs/qwen3-omni.md, section
"The vocoder"; figures in section "Float32 and float64").
Here nothing is re-decoded:
- the pre-transformer keeps its KV cache across chunks (its sliding window bounds the cache), so
  its outputs for new frames are those of one forward over everything;
- each convolution keeps the last inputs its kernel reaches back to (`_CausalConv`: (k - 1) x
  dilation samples, zeros before the first, as the left padding of one forward), and each
  transposed convolution its last ceil(k / stride) - 1 inputs (`_TransConv`); the other layers of
  the stack (SnakeBeta, LayerNorm, linears, residual adds) act on each time step alone.
A transposed convolution with kernel 2 x stride needs the next input for its last output block;
one forward trims that block, and so does each chunk here, and the next chunk makes it. So each
chunk yields global samples [emitted, frames_seen*U - L), the same L held back as one forward.
The previous version re-ran the convolutions over 12 frames of left context per chunk:
1.6x the convolution work of one forward for a 64-frame stream in the talker's chunks (4, 8, 16,
25, 11).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from services.code2wav.vocoder import EMPTY, VocoderGeometry


def _extend(history: torch.Tensor, x: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(history then x, its last `keep` samples as the next history). The next history is a copy:
    a view would keep the whole chunk's input alive (152 MiB a request at the real widths,
    measured)."""
    full = torch.cat([history, x], dim=-1) if history.shape[-1] else x
    return full, full[..., full.shape[-1] - min(keep, full.shape[-1]):].clone()


class _CausalConv:
    """Qwen3OmniMoeCausalConvNet (stride 1): left padding (k - 1) x dilation, kept across chunks."""

    def __init__(self, module: nn.Module, like: torch.Tensor):
        conv = module.conv
        if conv.stride != (1,) or conv.padding != (0,):
            raise NotImplementedError(f"streaming a causal conv with stride {conv.stride}, padding {conv.padding}")
        self.conv = conv
        self.history = like.new_zeros((1, conv.in_channels, module.padding))  # the samples before the chunk

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == 0:
            return x.new_zeros((1, self.conv.out_channels, 0))
        full, self.history = _extend(self.history, x, self.history.shape[-1])
        return self.conv(full)


class _TransConv:
    """Qwen3OmniMoeCausalTransConvNet: a transposed conv that trims k - stride samples at each end."""

    def __init__(self, module: nn.Module, like: torch.Tensor):
        conv = module.conv
        if conv.padding != (0,) or conv.output_padding != (0,) or conv.dilation != (1,):
            raise NotImplementedError("streaming a transposed conv with padding or dilation")
        self.conv = conv
        self.stride = conv.stride[0]
        self.keep = math.ceil(conv.kernel_size[0] / self.stride) - 1  # inputs an output block needs before it
        self.history = like.new_zeros((1, conv.in_channels, 0))
        self.start = 0  # global index of history's first input
        self.emitted = module.left_pad  # global output position of the next sample to emit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == 0:
            return x.new_zeros((1, self.conv.out_channels, 0))
        start = self.start
        full, self.history = _extend(self.history, x, self.keep)
        end = (start + full.shape[-1]) * self.stride  # outputs before it have all their inputs
        y = self.conv(full)[..., self.emitted - start * self.stride:end - start * self.stride]
        self.emitted = end
        self.start += full.shape[-1] - self.history.shape[-1]
        return y


class _ConvNeXt:
    """Qwen3OmniMoeConvNeXtBlock.forward with its depthwise conv streamed."""

    def __init__(self, module: nn.Module, like: torch.Tensor):
        self.block = module
        self.dwconv = _CausalConv(module.dwconv, like)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b = self.block
        h = self.dwconv(x).permute(0, 2, 1)
        h = b.pwconv2(b.act(b.pwconv1(b.norm(h))))
        return x + (b.gamma * h).permute(0, 2, 1)


class _Residual:
    """Qwen3OmniMoeCode2WavDecoderResidualUnit.forward with both convs streamed."""

    def __init__(self, module: nn.Module, like: torch.Tensor):
        self.unit = module
        self.conv1 = _CausalConv(module.conv1, like)
        self.conv2 = _CausalConv(module.conv2, like)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        u = self.unit
        return x + self.conv2(u.act2(self.conv1(u.act1(x))))


class _Sequence:
    def __init__(self, layers: list):
        self.layers = layers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _streamed(module: nn.Module, like: torch.Tensor):
    """The streaming twin of one layer of Qwen3OmniMoeCode2Wav's convolution stack."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    if isinstance(module, m.Qwen3OmniMoeCausalConvNet):
        return _CausalConv(module, like)
    if isinstance(module, m.Qwen3OmniMoeCausalTransConvNet):
        return _TransConv(module, like)
    if isinstance(module, m.Qwen3OmniMoeConvNeXtBlock):
        return _ConvNeXt(module, like)
    if isinstance(module, m.Qwen3OmniMoeCode2WavDecoderResidualUnit):
        return _Residual(module, like)
    if isinstance(module, m.Qwen3OmniMoeCode2WavDecoderBlock):
        return _Sequence([_streamed(layer, like) for layer in module.block])
    if isinstance(module, m.Qwen3OmniMoeSnakeBeta):
        return module  # acts on each time step alone
    if isinstance(module, nn.ModuleList):
        return _Sequence([_streamed(layer, like) for layer in module])
    raise NotImplementedError(f"no streaming form of {type(module).__name__}")


class IncrementalDecoder:
    """Per-request state: the pre-transformer's KV cache and every convolution's history."""

    def __init__(self, model, geometry: VocoderGeometry):
        from transformers import DynamicCache

        self.model = model
        self.geometry = geometry
        self.num_quantizers = int(model.config.num_quantizers)
        self._cache = DynamicCache(config=model.pre_transformer.config)
        parameter = next(model.parameters())
        self._device = parameter.device
        like = parameter.new_zeros(())  # the model's device and dtype
        self._stack = _Sequence([_streamed(model.upsample, like), _streamed(model.decoder, like)])
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
        codes = frames.to(device=self._device, dtype=torch.long).t().unsqueeze(0)  # [1, Q, n]
        embedded = model.code_embedding(codes + model.code_offset).mean(1)  # [1, n, H]
        hidden = model.pre_transformer(inputs_embeds=embedded, past_key_values=self._cache,
                                       use_cache=True).last_hidden_state  # [1, n, H]
        # Qwen3OmniMoeCode2Wav.forward after its pre-transformer, one chunk at a time.
        out = self._stack(hidden.permute(0, 2, 1)).clamp(min=-1, max=1)[0, 0]
        self._frames_seen += n
        self._samples_emitted += out.shape[-1]
        U, L = self.geometry.samples_per_frame, self.geometry.lookahead_samples
        assert self._samples_emitted == self._frames_seen * U - L, "vocoder output length drifted"
        return out.float().cpu().numpy()

    def finish(self) -> np.ndarray:
        """One forward trims the samples that need later frames, and so does each chunk: nothing
        is pending."""
        return EMPTY.copy()
