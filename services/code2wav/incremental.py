"""Exact streaming vocoding for any window: Qwen3OmniMoeCode2Wav.forward one block of frames at a
time (blocks.py), every layer carrying the state it needs, so each frame is convolved once and
the audio does not depend on how the talker cut the stream.

NOTE: why the state. `WindowDecoder` (window.py) re-decodes a left context before every block;
that is exact only while the context covers the vocoder's whole reach back: the transformer's
layers x (window - 1) frames plus the convolutions' ~10 frames (the real layout, 8 layers of
window 72, reaches ~580 frames; 25 frames of context give 3-4 dB there: docs/qwen3-omni.md, "The
vocoder"). Here nothing is re-decoded:
- the pre-transformer keeps the keys and values of the last window - 1 frames per layer, in a
  buffer of fixed size (zeros, masked out, before the first frame), so its outputs for new frames
  are those of one forward over everything;
- each convolution keeps the last inputs its kernel reaches back to (`_CausalConv`: (k - 1) x
  dilation samples, zeros before the first, as the left padding of one forward), and each
  transposed convolution its last ceil(k / stride) - 1 inputs (`_TransConv`); the other layers of
  the stack (SnakeBeta, LayerNorm, linears, GELU, residual adds) act on each time step alone.
A transposed convolution with kernel 2 x stride needs the next input for its last output block;
one forward trims that block, and so does each block here, and the next block makes it: the decode
of a block of frames [f, f + n) gives global samples [f*U - L, (f + n)*U - L), the first [0, n*U - L).

NOTE: why the bits do not depend on the cuts (docs/architecture.md, "Why each path is
invariant"). Every call decodes a whole block of the grid, so every op sees one shape for each
block size (and another for the first block, whose transposed convolutions have no history yet):
the embedding lookup and its mean over the codebooks, the transformer's linears, RMSNorms and
SDPA over the fixed key buffer, each convolution over its history plus the block, each transposed
convolution, the pointwise layers. The rotary cos/sin of a frame come from a table computed in
fixed spans of positions (`_RotaryTable`), so they depend on the position alone. A frame also sits
at the same place in every call it takes part in (its offset in its block), so a kernel that
treats a vectorised body and a scalar tail differently treats it the same way each time. Same
kernel, shape, place and inputs: the same bits, with the state after each whole block the same by
induction. The zero frames that pad an open block never reach an emitted sample: attention is
causal (they come after every real query), convolutions are causal, and the transposed
convolutions' outputs that read them are the L held-back samples. The start-up check (probe.py)
checks both on the machine, and batching across requests only where rows keep their bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from services.code2wav.blocks import Block, BlockGrid
from services.code2wav.vocoder import VocoderGeometry

State = list[torch.Tensor]  # one request's state after its whole blocks, each tensor [1, ...]


class _Carry:
    """One call's state tensors in layer order: each streamed layer takes its history ([G, ...])
    and gives the one after the block (a view: `IncrementalVocoder.decode` clones what it keeps).
    `rows`: the dense convolutions run one request's row at a time (the check's choice, probe.py)."""

    def __init__(self, old: list[torch.Tensor], rows: bool):
        self._old: Iterator[torch.Tensor] = iter(old)
        self.new: list[torch.Tensor] = []
        self.rows = rows

    def conv(self, conv: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """conv(x [G, C, T]): batched, or per row with the shape the row has alone."""
        if not self.rows or x.shape[0] == 1:
            return conv(x)
        return torch.cat([conv(x[i:i + 1]) for i in range(x.shape[0])])

    def take(self) -> torch.Tensor:
        return next(self._old)

    def give(self, history: torch.Tensor) -> None:
        self.new.append(history)


class _CausalConv:
    """Qwen3OmniMoeCausalConvNet (stride 1): left padding (k - 1) x dilation, carried across blocks."""

    def __init__(self, module: nn.Module):
        conv = module.conv
        if conv.stride != (1,) or conv.padding != (0,):
            raise NotImplementedError(f"streaming a causal conv with stride {conv.stride}, padding {conv.padding}")
        # nn.Conv1d.forward's own call, without the module's dispatch (a call per layer per block)
        self.conv = partial(torch.conv1d, weight=conv.weight, bias=conv.bias, dilation=conv.dilation, groups=conv.groups)
        self.in_channels = conv.in_channels
        self.keep = module.padding  # the samples before the block its kernel reads

    def initial(self, like: torch.Tensor) -> State:
        return [like.new_zeros((1, self.in_channels, self.keep))] if self.keep else []

    def __call__(self, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
        if not self.keep:
            return carry.conv(self.conv, x)
        full = torch.cat([carry.take(), x], dim=-1)
        carry.give(full[..., full.shape[-1] - self.keep:])
        return carry.conv(self.conv, full)


class _TransConv:
    """Qwen3OmniMoeCausalTransConvNet: a transposed conv that trims k - stride samples at each end."""

    def __init__(self, module: nn.Module):
        conv = module.conv
        if conv.padding != (0,) or conv.output_padding != (0,) or conv.dilation != (1,):
            raise NotImplementedError("streaming a transposed conv with padding or dilation")
        self.conv = partial(torch.conv_transpose1d, weight=conv.weight, bias=conv.bias, stride=conv.stride)
        self.in_channels = conv.in_channels
        self.stride = conv.stride[0]
        self.keep = math.ceil(conv.kernel_size[0] / self.stride) - 1  # inputs an output block needs before it
        self.left_pad = module.left_pad  # what one forward trims at the start

    def initial(self, like: torch.Tensor) -> State:
        return [like.new_zeros((1, self.in_channels, 0))] if self.keep else []  # empty before the first block

    def __call__(self, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
        history = carry.take() if self.keep else x[..., :0]
        full = torch.cat([history, x], dim=-1) if history.shape[-1] else x
        if self.keep:
            carry.give(full[..., full.shape[-1] - self.keep:])
        # Raw outputs before `first` were made by the previous block (or are the trimmed left pad),
        # those from `end` on need the next input.
        first = history.shape[-1] * self.stride if history.shape[-1] else self.left_pad
        return carry.conv(self.conv, full)[..., first:full.shape[-1] * self.stride]


class _ConvNeXt:
    """Qwen3OmniMoeConvNeXtBlock.forward with its depthwise conv streamed."""

    def __init__(self, module: nn.Module):
        self.block = module
        self.dwconv = _CausalConv(module.dwconv)

    def initial(self, like: torch.Tensor) -> State:
        return self.dwconv.initial(like)

    def __call__(self, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
        b = self.block
        h = self.dwconv(x, carry).permute(0, 2, 1)
        h = F.layer_norm(h, b.norm.normalized_shape, b.norm.weight, b.norm.bias, b.norm.eps)
        h = F.linear(F.gelu(F.linear(h, b.pwconv1.weight, b.pwconv1.bias)), b.pwconv2.weight, b.pwconv2.bias)
        return x + (b.gamma * h).permute(0, 2, 1)


class _Residual:
    """Qwen3OmniMoeCode2WavDecoderResidualUnit.forward with both convs streamed."""

    def __init__(self, module: nn.Module):
        self.act1, self.act2 = _Snake(module.act1), _Snake(module.act2)
        self.conv1 = _CausalConv(module.conv1)
        self.conv2 = _CausalConv(module.conv2)

    def initial(self, like: torch.Tensor) -> State:
        return self.conv1.initial(like) + self.conv2.initial(like)

    def __call__(self, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x), carry)), carry)


class _Snake:
    """Qwen3OmniMoeSnakeBeta.forward, x + 1 / (exp(beta) + eps) * sin(x * exp(alpha))^2, with the
    parameters' exponentials computed once instead of every call (the same ops on the same values,
    so the same bits). Acts on each element alone: no state."""

    def __init__(self, module: nn.Module):
        with torch.no_grad():
            self.alpha = torch.exp(module.alpha.unsqueeze(0).unsqueeze(-1))  # [1, C, 1]
            self.scale = 1.0 / (torch.exp(module.beta.unsqueeze(0).unsqueeze(-1)) + module.no_div_by_zero)

    def initial(self, like: torch.Tensor) -> State:
        return []

    def __call__(self, x: torch.Tensor, carry: _Carry | None = None) -> torch.Tensor:
        return x + self.scale * torch.pow(torch.sin(x * self.alpha), 2)


class _Sequence:
    def __init__(self, layers: list):
        self.layers = layers

    def initial(self, like: torch.Tensor) -> State:
        return [t for layer in self.layers for t in layer.initial(like)]

    def __call__(self, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, carry)
        return x


def _streamed(module: nn.Module):
    """The streaming twin of one layer of Qwen3OmniMoeCode2Wav's convolution stack."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    if isinstance(module, m.Qwen3OmniMoeCausalConvNet):
        return _CausalConv(module)
    if isinstance(module, m.Qwen3OmniMoeCausalTransConvNet):
        return _TransConv(module)
    if isinstance(module, m.Qwen3OmniMoeConvNeXtBlock):
        return _ConvNeXt(module)
    if isinstance(module, m.Qwen3OmniMoeCode2WavDecoderResidualUnit):
        return _Residual(module)
    if isinstance(module, m.Qwen3OmniMoeCode2WavDecoderBlock):
        return _Sequence([_streamed(layer) for layer in module.block])
    if isinstance(module, m.Qwen3OmniMoeSnakeBeta):
        return _Snake(module)
    if isinstance(module, nn.ModuleList):
        return _Sequence([_streamed(layer) for layer in module])
    raise NotImplementedError(f"no streaming form of {type(module).__name__}")


class _KeyBuffer:
    """The cache the attention layers see during one call: each layer's keys and values of the
    window - 1 frames before the block ([G, kv_heads, window - 1, head_dim]), then the block's."""

    def __init__(self, past: list[torch.Tensor]):
        self.past = past  # [k0, v0, k1, v1, ...]
        self.full: list[torch.Tensor] = []

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys = torch.cat([self.past[2 * layer_idx], key], dim=2)
        values = torch.cat([self.past[2 * layer_idx + 1], value], dim=2)
        self.full += [keys, values]
        return keys, values


class _RotaryTable:
    """cos/sin of the pre-transformer's rotary embedding per absolute position, computed `span`
    positions at a time with one fixed-shape call each, so a position's values do not depend on
    which other positions a call holds."""

    span = 256

    def __init__(self, rotary: nn.Module, like: torch.Tensor):
        self.rotary = rotary
        self.like = like
        self._cos: list[torch.Tensor] = []  # span i: [span, head_dim]
        self._sin: list[torch.Tensor] = []

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [G, n] int64 -> cos, sin [G, n, head_dim]."""
        needed = int(positions.max()) // self.span + 1
        while len(self._cos) < needed:
            start = len(self._cos) * self.span
            ids = torch.arange(start, start + self.span, device=self.like.device).unsqueeze(0)
            cos, sin = self.rotary(self.like, ids)
            self._cos.append(cos[0])
            self._sin.append(sin[0])
        cos, sin = torch.cat(self._cos), torch.cat(self._sin)
        return cos[positions], sin[positions]


class IncrementalVocoder:
    """Qwen3OmniMoeCode2Wav over blocks of the grid of several requests at once, each from its own
    state (`start` makes a new request's). No request bookkeeping: that is BlockStream's."""

    def __init__(self, model, geometry: VocoderGeometry, grid: BlockGrid):
        pre = model.pre_transformer
        config = pre.config
        self.layers = int(config.num_hidden_layers)
        if any(kind != "sliding_attention" for kind in config.layer_types[:self.layers]):
            raise NotImplementedError("streaming a vocoder transformer with full-attention layers")
        self.model = model
        self.geometry = geometry
        self.grid = grid
        self.context = 0  # frames before a block that its decode reads: none, the state holds them
        self.num_quantizers = int(model.config.num_quantizers)
        self.window = int(config.sliding_window)
        parameter = next(model.parameters())
        self._device = parameter.device
        like = parameter.new_zeros(())  # the model's device and dtype
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        past = like.new_zeros((1, config.num_key_value_heads, self.window - 1, head_dim))
        self._stack = _Sequence([_streamed(model.upsample), _streamed(model.decoder)])
        self._initial: State = [past] * (2 * self.layers) + self._stack.initial(like)  # never written in place
        self._rotary = _RotaryTable(pre.rotary_emb, like)

    rows_alone = False  # `decode(rows=True)` batches all but the dense convolutions: checked

    def start(self) -> State:
        return list(self._initial)

    def shape_key(self, index: int) -> tuple[bool, int]:
        """Blocks of equal key decode with equal shapes: the block's size, and whether it is the
        first (whose transposed convolutions have no history)."""
        return index == 0, self.grid.size(index)

    def first_sample(self, block: Block) -> int:
        """The global sample where `block`'s decode output starts."""
        U, L = self.geometry.samples_per_frame, self.geometry.lookahead_samples
        return 0 if block.index == 0 else block.first_frame * U - L

    @torch.inference_mode()
    def decode(self, blocks: list[Block], states: list[State], rows: bool = False
               ) -> tuple[torch.Tensor, list[State | None]]:
        """Blocks of one `shape_key`, one per request, with each request's state -> (wav [G, T]
        float32, the state after each block: None for an open block, whose state is never kept).
        `rows`: the dense convolutions one row at a time."""
        model = self.model
        codes = torch.stack([b.frames for b in blocks]).to(self._device).transpose(1, 2)  # [G, Q, n]
        embedded = model.code_embedding(codes + model.code_offset).mean(1)  # [G, n, H]
        stacked = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*states)]
        kv = 2 * self.layers
        hidden, past = self._transformer(embedded, blocks, stacked[:kv])  # [G, n, H]
        carry = _Carry(stacked[kv:], rows)
        wav = self._stack(hidden.permute(0, 2, 1), carry).clamp(min=-1, max=1)[:, 0]  # [G, T]
        after = past + carry.new
        return wav, [[t[i:i + 1].clone() for t in after] if block.full else None for i, block in enumerate(blocks)]

    def _transformer(self, embedded: torch.Tensor, blocks: list[Block], past: list[torch.Tensor]
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The pre-transformer's layers over the blocks (n frames each) against the key buffers ->
        (hidden [G, n, H], each layer's keys and values of the last window - 1 frames)."""
        pre = self.model.pre_transformer
        size, window = embedded.shape[1], self.window
        starts = torch.tensor([b.first_frame for b in blocks]).unsqueeze(1)  # [G, 1]
        positions = starts + torch.arange(size)  # [G, n]: each query's frame
        keys_at = (starts - (window - 1) + torch.arange(window - 1 + size)).unsqueeze(1)  # [G, 1, S]: each slot's frame
        query = positions.unsqueeze(2)  # [G, n, 1]
        # Sliding-window causal attention (a query sees the `window` frames up to itself); slots
        # before the first frame are masked out.
        mask = ((keys_at >= 0) & (keys_at <= query) & (keys_at > query - window)).unsqueeze(1)  # [G, 1, n, S]
        positions = positions.to(self._device)
        cache = _KeyBuffer(past)
        rotary = self._rotary(positions)
        hidden = embedded
        for layer in pre.layers[:self.layers]:
            hidden = layer(hidden, attention_mask=mask.to(self._device), position_embeddings=rotary,
                           position_ids=positions, past_key_values=cache)
        return pre.norm(hidden), [t[:, :, size:] for t in cache.full]
