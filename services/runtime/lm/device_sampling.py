"""Token selection on the model's device: a step's rows in one batched pass, one copy back.

The host path (sampling.py) copies a step's logits [B, vocab] to the CPU and draws each row with
the request's CPU generator: bit for bit `generate`'s draws, so it stays the CPU default. On a GPU
that costs a [B, 152064] transfer, a sync and B rounds of host ops a step. Here the same
processors run on the device over all rows at once, with each row's settings as [B] tensors:

- repetition penalty from a per-slot `seen` mask [num_slots, vocab] kept on the device, updated in
  place with each step's ids and reset when a slot takes a new request (its history: the thinker's
  prompt ids, Qwen2.5-Omni's talker's start codes). Applied as a mask over the row (divide
  positive, multiply negative scores of seen ids): the float32 products and quotients the host's
  gather/scatter gives, so greedy rows pick the host path's ids bit for bit;
- suppressed ids, then for sampled rows temperature, top-k (scores below the k-th kept out, ties
  kept) and top-p (from the least likely up, the tokens whose cumulative probability is at most
  1 - top_p dropped, the most likely always kept), from one descending sort;
- the draw: argmax of probs / E with E ~ Exp(1) per token (the exponential race, which picks each
  token with its probability; what vLLM does). E comes from a counter-based hash, not a generator:
  the uniform of token t in a row is lowbias32(lowbias32(lowbias32(key) ^ counter) ^ t), where `key`
  is the request's (its seed, or a random one drawn at admission) and `counter` the draw's place in
  the request (the thinker: its token index; the talker: frame * 16 + code group). Integer ops only,
  so a row's noise depends on nothing but (key, counter, t): the same seed replays the same tokens
  on the same device whatever shares its batch, with no per-row generator call. (Across devices the
  noise is the same bits; softmax's float rounding may still differ.)

A step gathers on the device what the host needs (ids, the talker's codes, rows for the next stage)
and `HostCopy` brings them back in one pinned, non-blocking copy and one event wait: the step's
only host sync. The engines pick this path where their device is cuda (`device_sampling` None) or
where told (tests run it on CPU tensors).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.device import to_device

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), with no product past 2^63 (signed overflow)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 integer hash on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def exponential_noise(keys: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 Exp(1) draws, a function of each row's (key, counter) and the token id only."""
    row = lowbias32(lowbias32(keys & _MASK32) ^ (counters & _MASK32))  # [B]
    bits = lowbias32(row[:, None] ^ torch.arange(vocab, device=keys.device))  # [B, vocab]
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1)
    return -torch.log(uniform)


def draw_key(cfg: SamplingConfig) -> int:
    """A request's noise key: its seed where it sent one (replayable), else random."""
    seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(8), "little")
    return (seed ^ (seed >> 32)) & _MASK32


@dataclass(frozen=True)
class Draw:
    """One row of a step: the request's settings, where its penalty history lives and its noise."""

    slot: int
    cfg: SamplingConfig
    key: int = 0
    counter: int = 0
    forced: int = -1  # an id to take instead of drawing (-1: draw)


VARIANTS = ("greedy", "sampled", "truncated")  # the sampler's op sets a captured step is made for


def idle_params(slot: int) -> list[float]:
    """A `Rows.params` column that draws nothing anyone reads: a padded row of a captured step, its
    penalty history in `slot` (the scratch slot, which no request owns)."""
    return [slot, 0, 0, -1, 0, 0.0, 1.0, 1.0]


class Rows:
    """A step's rows as the device sampler takes them: their settings as [B] device tensors (one
    host-to-device copy of `params` [8, B]; float64 holds each exactly: ints below 2^53, float32
    wire values) and what the host knows of them, so that only the processors some row asks for run.
    `variant` names that op set for a captured step (`VARIANTS`: greedy rows, penalty and forced ids
    included; temperature draws; top-k / top-p as well)."""

    def __init__(self, draws: Sequence[Draw], device):
        cfgs = [d.cfg for d in draws]
        params = to_device([[d.slot for d in draws], [d.key for d in draws], [d.counter for d in draws],
                            [d.forced for d in draws], [c.top_k for c in cfgs],
                            [0.0 if c.greedy else c.temperature for c in cfgs], [c.top_p for c in cfgs],
                            [c.repetition_penalty for c in cfgs]], torch.float64, device)
        sampled = [c for c in cfgs if not c.greedy]
        self._read(params, penalized=any(c.repetition_penalty != 1.0 for c in cfgs), sampled=bool(sampled),
                   truncated=any(c.top_k > 0 or c.top_p < 1.0 for c in sampled),
                   has_forced=any(d.forced >= 0 for d in draws))

    @classmethod
    def captured(cls, params: torch.Tensor, variant: str) -> Rows:
        """The rows of a captured step: `params` a graph input, the op set fixed by `variant` (a
        penalty of 1 and a forced id of -1 leave a row as it is, so every variant runs both)."""
        rows = cls.__new__(cls)
        rows._read(params, penalized=True, sampled=variant != "greedy", truncated=variant == "truncated",
                   has_forced=True)
        return rows

    def _read(self, params: torch.Tensor, **flags: bool) -> None:
        self.params = params
        self.slots, self.keys, self.counters, self.forced, self.top_k = params[:5].to(torch.long)
        self.temperature, self.top_p, self.penalty = params[5:].to(torch.float32)
        self.penalized, self.sampled = flags["penalized"], flags["sampled"]
        self.truncated, self.has_forced = flags["truncated"], flags["has_forced"]

    @property
    def variant(self) -> str:
        return "truncated" if self.truncated else "sampled" if self.sampled else "greedy"


class SlotSampler:
    """The device sampler of one engine: the `seen` mask of its slots and the batched draw."""

    def __init__(self, num_slots: int, vocab: int, device, suppress: torch.Tensor | None = None):
        self.device = device
        self.vocab = vocab
        self.seen = torch.zeros((num_slots, vocab), dtype=torch.bool, device=device)
        self.suppress = suppress.to(device) if suppress is not None else None

    def reset(self, slot: int, history: Sequence[int] = ()) -> None:
        """A slot taken by a new request: its penalty history is `history` (ids), nothing else."""
        self.seen[slot].zero_()
        if history:
            self.seen[slot].index_fill_(0, to_device(sorted(set(history)), torch.long, self.device), True)

    def sample(self, logits: torch.Tensor, rows: Rows | Sequence[Draw], remember: bool = True,
               counter_offset: int = 0) -> torch.Tensor:
        """logits [B, vocab] -> ids [B] long on the device, no host sync. `rows`: the B rows (made
        once where several draws share them, as a code predictor frame's 15 do, each `counter_offset`
        further on); with `remember`, each id joins its slot's penalty history."""
        if not isinstance(rows, Rows):
            rows = Rows(rows, self.device)
        scores = logits.float()
        if rows.penalized:
            penalty = rows.penalty[:, None]
            penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
            scores = torch.where(self.seen.index_select(0, rows.slots) & (penalty != 1.0), penalized, scores)
        if self.suppress is not None:
            scores = scores.masked_fill(self.suppress, float("-inf"))
        ids = torch.argmax(scores, dim=-1)
        if rows.sampled:
            greedy = rows.temperature == 0.0
            scores = scores / torch.where(greedy, 1.0, rows.temperature)[:, None]
            if rows.truncated:
                scores = self._top_k_top_p(scores, rows.top_k, rows.top_p)
            probs = torch.softmax(scores, dim=-1)
            noise = exponential_noise(rows.keys, rows.counters + counter_offset, scores.shape[-1])
            ids = torch.where(greedy, ids, torch.argmax(probs / noise, dim=-1))
        if rows.has_forced:
            ids = torch.where(rows.forced >= 0, rows.forced, ids)
        if remember:
            self.seen.index_put_((rows.slots, ids), torch.ones((), dtype=torch.bool, device=self.device))
        return ids

    @staticmethod
    def _top_k_top_p(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Top-k then top-p per row (sampling.process_scores' semantics) from one descending sort."""
        vocab = scores.shape[-1]
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = ordered.gather(1, (k - 1)[:, None])  # [B, 1]
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        # Ascending, as TopPLogitsWarper: drop what sums to at most 1 - top_p from the least likely up.
        ascending = ordered.flip(-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p)[:, None]
        drop[:, -1] = False
        keep = ~drop.flip(-1)  # back in descending order
        keep = keep & (ordered > float("-inf"))
        return scores.masked_fill(~torch.zeros_like(keep).scatter(1, order, keep), float("-inf"))


NONFINITE = -1  # the id a row whose logits hold NaN or inf reads as on the host (`mark_nonfinite`)


def mark_nonfinite(ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """ids [B] as the host gets them: NONFINITE where the row's logits [B, vocab] are not all finite
    (a bad weight file, a bad input), so the host ends that request alone. The device keeps using
    the drawn ids (an index of -1 into an embedding would be a device-side assert)."""
    return torch.where(torch.isfinite(logits).all(dim=-1), ids, NONFINITE)


class HostCopy:
    """What one step copies to the host: device tensors laid into one byte buffer on the device,
    copied once into pinned memory (non-blocking), then one event wait. On CPU the same code with an
    explicit copy, so a test can count it."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.parts: list[torch.Tensor] = []

    def add(self, tensor: torch.Tensor) -> int:
        """Queue `tensor` (on the device); its index in what `fetch` returns."""
        self.parts.append(tensor)
        return len(self.parts) - 1

    def clear(self) -> None:
        self.parts = []

    def fetch(self) -> list[torch.Tensor]:
        """Every queued tensor on the host, as it was (dtype, shape), through one copy."""
        parts, self.parts = self.parts, []
        if not parts:
            return []
        flat = torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])
        if self.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        else:  # the same one transfer, explicit (a copy even from CPU tensors)
            host = flat.to("cpu", copy=True)
        out, start = [], 0
        for p in parts:
            size = p.numel() * p.element_size()
            out.append(host[start:start + size].clone().view(p.dtype).view(p.shape))
            start += size
        return out


def device_sampling_wanted(setting: bool | None, device) -> bool:
    """An engine's `device_sampling`: None is on where the device is cuda (on CPU the host path is
    `generate`'s draws bit for bit), True or False as set."""
    return torch.device(device).type == "cuda" if setting is None else setting
