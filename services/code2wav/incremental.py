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
convolutions' outputs that read them are the L held-back samples. The start-up check (plan.py)
checks both on the machine, and batching across requests only where rows keep their bits.

NOTE: where the state lives. Every request's state is a row of one tensor on the model's device
(`_Pool`, a row per `Slot`: the key buffers and every convolution's history, each a span of the
row): a call gathers its requests' rows (one index_select, whatever the batch), and writes the
histories after its whole blocks back in place (one index_copy_ a history; an open block's go to
a scratch row, never read). A first block reads no row (zeros, as one forward's padding), so a slot
a new request takes needs no clearing. The mask's sliding-window band and the key slots' places
are built once per block size, the rotary table once (it only grows); a call uploads one int64
tensor (slots, first frames, codes) and copies one wav back. Nothing per request is left on the
host's side of a call, so it is a fixed sequence of kernels per (block shape, batch): on cuda with
graphs on it replays from a CUDA graph per (block shape, batch bucket); a batch above the largest
bucket, or a shape whose capture failed, decodes eagerly and batched (logged once). The values
each op sees are the ones it saw when every request carried its own tensors (rows gathered
instead of concatenated, the same mask and cos/sin), so the bits are too.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import weakref
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from services.base.stages import Stage
from services.code2wav.blocks import Block, BlockGrid
from services.code2wav.vocoder import VocoderGeometry
from services.runtime.lm.cuda_graphs import GraphRunner, pick_bucket
from services.runtime.lm.kernels import rows_apart
from services.runtime.model.device import upload
from services.runtime.model.settings import GraphSettings

log = logging.getLogger(__name__)

READ, WRITE, START = 0, 1, 2  # a call's int64 input, per row: these columns, then the block's codes
HEADER = 3


class Slot:
    """One request's state: its row of every history in the vocoder's pool, given back to the
    pool when the last reference to it goes (the engine's when the request ends or aborts)."""

    __slots__ = ("index", "__weakref__")

    def __init__(self, index: int):
        self.index = index


class _Pool:
    """Every request's histories, on the model's device: one tensor [capacity + 1, width], a row per
    slot (each history a span of it: `histories` are their views), the last row the scratch row
    that open blocks and padding rows write. When full it doubles, moving (`generation` counts the
    moves: a graph captured on the old tensor must go)."""

    def __init__(self, shapes: list[tuple[int, ...]], like: torch.Tensor, capacity: int):
        sizes = [math.prod(shape) for shape in shapes]
        self.spans = list(zip(itertools.accumulate(sizes, initial=0), shapes))  # (first column, shape) each
        self.width = sum(sizes)
        self.like = like
        self.capacity = 0
        self.tensor = like.new_zeros((0, self.width))
        self.histories: list[torch.Tensor] = []  # [capacity + 1, *shape] each
        self.generation = 0
        self._free: list[int] = []  # the slots' finalizers append to this very list
        self._grow(max(capacity, 1))

    @property
    def scratch(self) -> int:
        return self.capacity

    def take(self) -> Slot:
        if not self._free:
            self._grow(2 * self.capacity)
        slot = Slot(self._free.pop())
        weakref.finalize(slot, self._free.append, slot.index)
        return slot

    def fork(self, slot: Slot) -> Slot:
        """A new slot holding `slot`'s state now."""
        copy = self.take()
        self.tensor[copy.index].copy_(self.tensor[slot.index])
        return copy

    def rows(self, index: torch.Tensor) -> list[torch.Tensor]:
        """The histories of the slots `index` names ([G]): one gather, then views [G, *shape]."""
        rows = self.tensor.index_select(0, index)
        return [rows[:, start:start + math.prod(shape)].view(-1, *shape) for start, shape in self.spans]

    def _grow(self, capacity: int) -> None:
        old, kept = self.tensor, self.capacity
        self.tensor = self.like.new_zeros((capacity + 1, self.width))
        self.tensor[:kept].copy_(old[:kept])
        self.histories = [self.tensor[:, start:start + math.prod(shape)].view(-1, *shape) for start, shape in self.spans]
        self._free.extend(range(capacity - 1, kept - 1, -1))  # the lowest first
        self.capacity = capacity
        self.generation += 1


class _Carry:
    """One call's histories in layer order: each streamed layer takes the call's rows of its
    history ([G, ...]: None for a first block, which reads none) and gives the one after the
    block, written back to the pool when the call is done (`write`)."""

    def __init__(self, pool: _Pool, read: torch.Tensor | None):
        self._sources = iter(pool.rows(read) if read is not None else [None] * len(pool.histories))
        self._targets = iter(pool.histories)
        self._after: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(self) -> torch.Tensor | None:
        return next(self._sources)

    def give(self, after: torch.Tensor) -> None:
        self._after.append((next(self._targets), after))

    def write(self, index: torch.Tensor) -> None:
        """Every history after the block into the rows `index` names ([G])."""
        for history, after in self._after:
            history.index_copy_(0, index, after)


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

    def histories(self) -> list[tuple[int, ...]]:
        return [(self.in_channels, self.keep)] if self.keep else []

    def __call__(self, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
        if not self.keep:
            return self.conv(x)
        history = carry.take()
        full = F.pad(x, (self.keep, 0)) if history is None else torch.cat([history, x], dim=-1)
        carry.give(full[..., full.shape[-1] - self.keep:])
        return self.conv(full)


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

    def histories(self) -> list[tuple[int, ...]]:
        return [(self.in_channels, self.keep)] if self.keep else []

    def __call__(self, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
        history = carry.take() if self.keep else None  # none before the first block
        full = x if history is None else torch.cat([history, x], dim=-1)
        if self.keep:
            carry.give(full[..., full.shape[-1] - self.keep:])
        # Raw outputs before `first` were made by the previous block (or are the trimmed left pad),
        # those from `end` on need the next input.
        first = self.left_pad if history is None else history.shape[-1] * self.stride
        return self.conv(full)[..., first:full.shape[-1] * self.stride]


class _ConvNeXt:
    """Qwen3OmniMoeConvNeXtBlock.forward with its depthwise conv streamed."""

    def __init__(self, module: nn.Module):
        self.block = module
        self.dwconv = _CausalConv(module.dwconv)

    def histories(self) -> list[tuple[int, ...]]:
        return self.dwconv.histories()

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

    def histories(self) -> list[tuple[int, ...]]:
        return self.conv1.histories() + self.conv2.histories()

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

    def histories(self) -> list[tuple[int, ...]]:
        return []

    def __call__(self, x: torch.Tensor, carry: _Carry | None = None) -> torch.Tensor:
        return x + self.scale * torch.pow(torch.sin(x * self.alpha), 2)


class _Sequence:
    def __init__(self, layers: list):
        self.layers = layers

    def histories(self) -> list[tuple[int, ...]]:
        return [shape for layer in self.layers for shape in layer.histories()]

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
    """The cache the attention layers see during one call, in layer order: each layer's keys and
    values of the window - 1 frames before the block ([G, kv_heads, window - 1, head_dim]: the
    pool's rows, or zeros, masked out, before a first block), then the block's; the last window - 1
    given back."""

    def __init__(self, carry: _Carry, past: int):
        self.carry = carry
        self.past = past

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        full = []
        for new in (key, value):
            history = self.carry.take()
            both = F.pad(new, (0, 0, self.past, 0)) if history is None else torch.cat([history, new], dim=2)
            self.carry.give(both[:, :, both.shape[2] - self.past:])
            full.append(both)
        return tuple(full)


class _RotaryTable:
    """cos/sin of the pre-transformer's rotary embedding per absolute position, computed `span`
    positions at a time with one fixed-shape call each, so a position's values do not depend on
    which other positions a call holds. One tensor each, grown (moved) by doubling."""

    span = 256

    def __init__(self, rotary: nn.Module, like: torch.Tensor, positions: int):
        self.rotary = rotary
        self.like = like
        self.positions = 0
        self.cos = self.sin = None  # [positions, head_dim] each
        self.cover(positions)

    def cover(self, positions: int) -> bool:
        """Hold positions [0, `positions`); True where the tensors had to move."""
        if positions <= self.positions:
            return False
        spans = max(-(-positions // self.span), 2 * self.positions // self.span)
        cos, sin = ([self.cos], [self.sin]) if self.positions else ([], [])
        for start in range(self.positions, spans * self.span, self.span):
            ids = torch.arange(start, start + self.span, device=self.like.device).unsqueeze(0)
            span_cos, span_sin = self.rotary(self.like, ids)
            cos.append(span_cos[0])
            sin.append(span_sin[0])
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)
        self.positions = spans * self.span
        return True

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [G, n] int64 -> cos, sin [G, n, head_dim]."""
        return self.cos[positions], self.sin[positions]


class IncrementalVocoder:
    """Qwen3OmniMoeCode2Wav over blocks of the grid of several requests at once, each from its own
    state (`start` gives a new request's slot). No request bookkeeping: that is BlockStream's.
    `graphs`: the calls replayed from CUDA graphs (cuda only); `slots`: the pool's first size."""

    def __init__(self, model, geometry: VocoderGeometry, grid: BlockGrid, graphs: GraphSettings | None = None,
                 slots: int = 8, positions: int = 4096):
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
        self._stack = _Sequence([_streamed(model.upsample), _streamed(model.decoder)])
        past = (config.num_key_value_heads, self.window - 1, head_dim)
        self._pool = _Pool([past] * (2 * self.layers) + self._stack.histories(), like, slots)
        self._rotary = _RotaryTable(pre.rotary_emb, like, positions)
        self._slots: dict[int, torch.Tensor] = {}  # block size -> [window - 1 + n]: each key slot's place
        self._bands: dict[int, torch.Tensor] = {}  # block size -> [n, window - 1 + n] bool
        self._graphs = graphs
        self._runners: dict[tuple[bool, bool], GraphRunner] = {}  # (first block, rows) -> its graphs
        self._captured_on = (self._pool.generation, self._rotary.positions)  # what the graphs read
        self._said_eager = False

    # `decode(rows=True)` gives each request the bits of its own call by construction (`rows_apart`):
    # no check of it needed.
    rows_alone = True

    def start(self) -> Slot:
        slot = self._pool.take()
        self._drop_stale_graphs()
        return slot

    def fork(self, state: Slot) -> Slot:
        """A copy of a request's state, which a decode of a whole block advances in place (the
        check decodes a block again from the state before it)."""
        copy = self._pool.fork(state)
        self._drop_stale_graphs()
        return copy

    def shape_key(self, index: int) -> tuple[bool, int]:
        """Blocks of equal key decode with equal shapes: the block's size, and whether it is the
        first (whose transposed convolutions have no history)."""
        return index == 0, self.grid.size(index)

    def first_sample(self, block: Block) -> int:
        """The global sample where `block`'s decode output starts."""
        U, L = self.geometry.samples_per_frame, self.geometry.lookahead_samples
        return 0 if block.index == 0 else block.first_frame * U - L

    @torch.inference_mode()
    def decode(self, blocks: list[Block], states: list[Slot], rows: bool = False
               ) -> tuple[torch.Tensor, list[Slot | None]]:
        """Blocks of one `shape_key`, one per request, with each request's slot -> (wav [G, T]
        float32 on the host, the slot after each block: None for an open block, whose state is
        not kept). A whole block's state replaces the one before it, in place. `rows`: the dense
        convolutions one row at a time."""
        first, size = self.shape_key(blocks[0].index)
        self._prepare(size, max(block.first_frame for block in blocks) + size)
        scratch = self._pool.scratch
        header = torch.tensor([[state.index, state.index if block.full else scratch, block.first_frame]
                               for block, state in zip(blocks, states)])
        ints = torch.cat([header, torch.stack([block.frames for block in blocks]).flatten(1)], dim=1)
        wav = self._run(first, rows, ints)
        return wav.cpu(), [state if block.full else None for block, state in zip(blocks, states)]

    @torch.inference_mode()
    def capture(self, max_batch: int) -> None:
        """With graphs on: every shape of the grid captured at every bucket up to the one that holds
        `max_batch` (others on first use)."""
        if self._graphs is None:
            return
        top = pick_bucket(max_batch, self._graphs.buckets) or max(self._graphs.buckets)
        for first, size in {self.shape_key(index) for index in range(len(self.grid.sizes) + 1)}:
            self._prepare(size, self.grid.first_frame(len(self.grid.sizes)) + size)
            for bucket in (b for b in self._graphs.buckets if b <= top):
                self._runner(first, False, HEADER + size * self.num_quantizers, bucket)
        runners = list(self._runners.values())
        log.info("code2wav incremental: %s", "; ".join(r.summary() for r in runners) or "no graphs")

    def _prepare(self, size: int, positions: int) -> None:
        """The mask's pieces for blocks of `size` frames, and the rotary table past `positions`."""
        if size not in self._slots:
            slots = torch.arange(self.window - 1 + size, device=self._device)
            self._slots[size] = slots
            # A query (frame i of the block) sees the `window` frames up to itself: key slots i to
            # i + window - 1 (slot j holds frame j - (window - 1) of the block).
            query = slots[:size].unsqueeze(1)
            self._bands[size] = (slots >= query) & (slots <= query + self.window - 1)
        self._rotary.cover(positions)
        self._drop_stale_graphs()

    def _drop_stale_graphs(self) -> None:
        """Graphs read the pool's and the rotary table's tensors: once either moved, capture again."""
        now = (self._pool.generation, self._rotary.positions)
        if now != self._captured_on:
            if self._runners:
                log.info("code2wav incremental: %d request slots, %d positions: CUDA graphs captured again "
                         "on first use", self._pool.capacity, self._rotary.positions)
            self._runners.clear()
            self._captured_on = now

    def _run(self, first: bool, rows: bool, ints: torch.Tensor) -> torch.Tensor:
        """The call on the device: replayed from the graph of its (shape, bucket), the batch padded
        with rows that read and write the scratch row; else eagerly over the batch as it is."""
        batch = ints.shape[0]
        bucket = self._bucket(batch)
        runner = self._runner(first, rows, ints.shape[1], bucket)
        if runner is None:
            return self._step(first, rows, upload(ints, self._device))
        padded = torch.cat([ints, self._padding(ints.shape[1], bucket - batch)]) if bucket > batch else ints
        (wav,) = runner((ints.shape[1], bucket), upload(padded, self._device))
        return wav[:batch]

    def _bucket(self, batch: int) -> int | None:
        if self._graphs is None:
            return None
        bucket = pick_bucket(batch, self._graphs.buckets)
        if bucket is None and not self._said_eager:
            self._said_eager = True
            log.warning("code2wav incremental: a batch of %d is above the largest CUDA graph bucket (%d): such "
                        "batches decode eagerly", batch, max(self._graphs.buckets))
        return bucket

    def _runner(self, first: bool, rows: bool, width: int, bucket: int | None) -> GraphRunner | None:
        """The runner holding the captured graph of this shape and bucket (captured now if new);
        None where there is none (graphs off, above the buckets, a capture that failed)."""
        if bucket is None:
            return None
        runner = self._runners.get((first, rows))
        if runner is None:
            runner = self._runners[first, rows] = GraphRunner(
                partial(self._step, first, rows), True, f"{Stage.CODE2WAV} incremental", max_graphs=1 << 10)
        if runner.enabled and not runner.has((width, bucket)):
            runner.capture((width, bucket), upload(self._padding(width, bucket), self._device))
        return runner if runner.enabled else None

    def _padding(self, width: int, rows: int) -> torch.Tensor:
        """Rows that read and write the scratch row, of silence codes from frame 0."""
        padding = torch.zeros((rows, width), dtype=torch.long)
        padding[:, READ] = padding[:, WRITE] = self._pool.scratch
        return padding

    def _step(self, first: bool, rows: bool, ints: torch.Tensor) -> torch.Tensor:
        """One call, all on the device: ints [G, 3 + n*Q] (each row's slot to read, slot to write,
        first frame, then its block's codes) -> wav [G, n*U - L] float32; every row's histories
        after the block written to its slot to write. `rows`: every row's bits its own call's, by
        construction (`rows_apart`)."""
        model, batch = self.model, ints.shape[0]
        size = (ints.shape[1] - HEADER) // self.num_quantizers
        read, write, start = (ints[:, column].contiguous() for column in (READ, WRITE, START))
        codes = ints[:, HEADER:].view(batch, size, self.num_quantizers).transpose(1, 2)  # [G, Q, n]
        with rows_apart() if rows else contextlib.nullcontext():
            embedded = model.code_embedding(codes + model.code_offset).mean(1)  # [G, n, H]
            carry = _Carry(self._pool, None if first else read)
            hidden = self._transformer(embedded, start, carry)  # [G, n, H]
            wav = self._stack(hidden.permute(0, 2, 1), carry).clamp(min=-1, max=1)[:, 0].float()  # [G, T]
        carry.write(write)
        return wav

    def _transformer(self, embedded: torch.Tensor, start: torch.Tensor, carry: _Carry) -> torch.Tensor:
        """The pre-transformer's layers over the blocks (n frames each, from frame `start` [G]) against
        the key buffers -> hidden [G, n, H]."""
        pre = self.model.pre_transformer
        size = embedded.shape[1]
        slots = self._slots[size]
        positions = start.unsqueeze(1) + slots[:size]  # [G, n]: each query's frame
        # Sliding-window causal attention (the band); key slots before the first frame masked out.
        seen = slots >= (self.window - 1 - start).unsqueeze(1)  # [G, S]
        mask = (self._bands[size] & seen.unsqueeze(1)).unsqueeze(1)  # [G, 1, n, S]
        cache = _KeyBuffer(carry, self.window - 1)
        rotary = self._rotary(positions)
        hidden = embedded
        for layer in pre.layers[:self.layers]:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions,
                           past_key_values=cache)
        return pre.norm(hidden)
