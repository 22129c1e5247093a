"""Qwen3-Omni's code2wav engine: decode the blocks of codec frames that are ready, several
requests' in one call.

A request's frames go onto the block grid as they arrive (blocks.py), so its audio does not
depend on how the talker cut them; a step decodes one block of each of up to `batch` requests
through the configured decoder's vocoder (`--decoder`, config.Decoder, chosen once by the family's
adapter, qwen3_adapter.py):
- `IncrementalVocoder` (the default, exact for any vocoder: the pre-transformer and every
  convolution carry their state per request, in slots on the device, incremental.py; with CUDA
  graphs its calls replay from a graph per (block shape, batch bucket));
- `WindowVocoder` (window.py: each block re-decoded with a left context, exact only while the
  context covers the vocoder's reach, the tiny checkpoint's, not the real 8-layer, window-72 one;
  with CUDA graphs, graphs.py, its windows replay from a graph per (length, batch bucket)).
Which batch sizes keep every request's bits, and whether an open block may be decoded before it is
whole, is exact mode's check's (plan.py, `BlockPlan`), adopted between steps when it passes.
Qwen2.5-Omni's engine is token2wav_engine.py, with the same inputs and events (below).

NOTE: which blocks a step takes, by deadline. A step's events reach the handlers only when the
step ends, so the step's requests are those whose listeners run dry first: before any audio the
time the request arrived (a first block is always late), after it the time of its first audio
plus the seconds of audio it has had, less the time audio takes from here to the listener
(`delivery_ms`: three hops through the talker, thinker and router, tens of ms on a loaded CPU). The
most due request picks the step's shape (blocks of one shape decode together, `shape_key`), the
most due others of that shape join it up to the largest allowed batch, within `--max-batch-frames`
(on a CPU a call over more frames than about 64 is slower a frame than smaller ones: its
activations leave the cache; docs/performance.md). A step is one block per
request, so a request about to underrun, or not yet heard, goes first. A whole block is
decodable at once; an open one (the talker cut its chunk early) only once it is due, so it is
decoded again only where its listener would otherwise have waited (`wake_in` says when).
Without the margin a running request counted as due only once its listener had already run dry,
so during a burst it waited behind every new request's first chunk (up to 180 ms in a probe at
concurrency 16), the talker's early chunks too (chunking.py, "running dry"): the two together cut
underruns at 16; either alone did not (docs/performance.md, "Early chunks when the listener is about
to run dry").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from services.base.engine import EngineDefaults, StepResult
from services.base.events import EngineEvent
from services.base.timing import ForwardTimer
from services.code2wav.blocks import BlockStream
from services.code2wav.plan import BlockPlan, adopt
from services.code2wav.vocoder import VocoderGeometry, model_device
from services.runtime.checks import StartupCheck
from services.runtime.model.device import device_clock


@dataclass(frozen=True)
class CodecChunk:
    frames: torch.Tensor  # [n, num_code_groups] int64


@dataclass(frozen=True)
class CodecEnd:
    pass


@dataclass(frozen=True)
class Audio(EngineEvent):
    samples: np.ndarray  # float32 [n]
    first_sample: int
    end_frame: int = 0  # frames decoded when it was made: the talker's cut (AudioChunk.end_frame)


@dataclass(frozen=True)
class Decoded(EngineEvent):
    samples: int
    frames: int
    final: ClassVar[bool] = True


def check_frames(frames: torch.Tensor, groups: int, vocab: int) -> None:
    """A chunk's codes must be [n, groups] ids in [0, vocab) (the adapters check the wire's first)."""
    if frames.ndim != 2 or frames.shape[1] != groups:
        raise ValueError(f"codec frames must be [n, {groups}], got {list(frames.shape)}")
    if frames.numel() and (frames.min() < 0 or frames.max() >= vocab):
        raise ValueError(f"codec ids must be in [0, {vocab})")


@dataclass
class _Request:
    stream: BlockStream
    state: object  # the vocoder's state after the request's whole blocks
    added_at: float = field(default_factory=time.monotonic)
    first_audio_at: float | None = None  # monotonic time of its first audio

    def deadline(self, sample_rate: int, delivery_s: float) -> float:
        """When this request's next audio must leave here for its listener not to run dry (see the
        module note)."""
        if self.first_audio_at is None:
            return self.added_at
        return self.first_audio_at + self.stream.samples_emitted / sample_rate - delivery_s


class Code2WavEngine(EngineDefaults):
    """Blocks of the most due requests a step, batched as the plan allows (the module note)."""

    def __init__(self, vocoder, plan: BlockPlan, config, delivery_ms: float = 100.0, check: StartupCheck | None = None):
        self.vocoder = vocoder  # IncrementalVocoder | WindowVocoder, built for plan.grid
        self.plan = plan
        self.exact_report = plan
        self.check = check  # exact mode's check beside serving, whose verdict replaces `plan` (plan.py)
        self.geometry: VocoderGeometry = vocoder.geometry
        self.codebook_size = int(config.code2wav_config.codebook_size)
        self.num_quantizers = int(config.code2wav_config.num_quantizers)
        self.delivery_s = delivery_ms / 1000  # audio's way from here to its listener (the module note)
        # Seconds in vocoder forwards (services/base/timing.py), waiting for the GPU's kernels on cuda.
        self.timer = ForwardTimer(clock=device_clock(model_device(vocoder.model)))
        self._requests: dict[str, _Request] = {}  # request_id -> its frames and state

    def add(self, request_id: str, _payload=None) -> None:
        stream = BlockStream(self.plan.grid, self.geometry, self.vocoder.context)
        self._requests[request_id] = _Request(stream, self.vocoder.start())

    def add_input(self, request_id: str, payload: CodecChunk | CodecEnd) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        if isinstance(payload, CodecEnd):
            request.stream.end()
            return
        check_frames(payload.frames, self.num_quantizers, self.codebook_size)
        request.stream.push(payload.frames)

    def abort(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def adopt_checks(self) -> None:
        """The faster plan, once the check beside serving found it (between steps: a request's bits
        are those it gets alone under either plan)."""
        if (plan := adopt(self.plan, self.check)) is not None:
            self.plan = self.exact_report = plan

    def close(self) -> None:
        """A check still running beside serving stops with the engine (checks.StartupCheck.stop)."""
        if self.check is not None:
            self.check.stop()

    def has_work(self) -> bool:
        now = time.monotonic()
        return any(r.stream.done or self._decodable(r, now) for r in self._requests.values())

    def wake_in(self) -> float | None:
        """Seconds until the first open block falls due (None: none waits)."""
        rate, now = self.geometry.sample_rate, time.monotonic()
        due = [r.deadline(rate, self.delivery_s) for r in self._requests.values()
               if self.plan.open_blocks and r.stream.ready and not r.stream.whole]
        return max(0.0, min(due) - now) if due else None

    def _decodable(self, request: _Request, now: float) -> bool:
        """A whole block now; an open one once its listener needs it (the module note), where the plan
        decodes open blocks."""
        stream = request.stream
        return stream.whole or (self.plan.open_blocks and stream.ready
                                and request.deadline(self.geometry.sample_rate, self.delivery_s) <= now)

    @property
    def queue_depth(self) -> int:
        """Requests with frames waiting for a decode."""
        return sum(r.stream.ready for r in self._requests.values())

    @property
    def running(self) -> int:
        return len(self._requests)

    def step(self) -> StepResult:
        """Every request whose stream ended with all its frames decoded ends; then one block each
        of the most due requests. (The end is a step of its own after the last block, whenever the
        end mark came: one step count for any timing.)"""
        self.adopt_checks()
        events = self._finish()
        batch = self._next_batch()
        return events + (self._decode(batch) if batch else [])

    def _finish(self) -> StepResult:
        """Decoded for every request whose stream ended with every frame decoded; their state goes."""
        events: StepResult = []
        for request_id, request in list(self._requests.items()):
            if request.stream.done:
                events.append((request_id, Decoded(request.stream.samples_emitted, request.stream.received)))
                del self._requests[request_id]
        return events

    def _next_batch(self) -> list[tuple[str, _Request]]:
        """The most due decodable request and the most due others whose next block has its shape."""
        rate, now = self.geometry.sample_rate, time.monotonic()
        ready = sorted(((r, q) for r, q in self._requests.items() if self._decodable(q, now)),
                       key=lambda item: item[1].deadline(rate, self.delivery_s))
        if not ready:
            return []
        key = self.vocoder.shape_key(ready[0][1].stream.blocks)
        same = [item for item in ready if self.vocoder.shape_key(item[1].stream.blocks) == key]
        size = self.plan.grid.size(ready[0][1].stream.blocks)
        return same[:self.plan.batch_for(len(same), size)]

    def _decode(self, batch: list[tuple[str, _Request]]) -> StepResult:
        """One call over the batch's blocks; each request takes its row, its audio goes up now."""
        blocks = [request.stream.next_block() for _, request in batch]
        with self.timer:
            wav, after = self.vocoder.decode(blocks, [request.state for _, request in batch], rows=self.plan.rows)
        events: StepResult = []
        for (request_id, request), block, row, state in zip(batch, blocks, wav, after):
            first = request.stream.samples_emitted
            samples = request.stream.accept(block, row, self.vocoder.first_sample(block))
            if state is not None:
                request.state = state
            if samples.size:
                if request.first_audio_at is None:
                    request.first_audio_at = time.monotonic()
                events.append((request_id, Audio(samples, first, request.stream.covered)))
        return events
