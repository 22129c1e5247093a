"""Qwen3-Omni's code2wav engines: decode the codec chunks that are ready.

One engine per decoder (`--decoder`, config.Decoder), picked once at start-up by the family's
adapter (qwen3_adapter.py):
- `IncrementalCode2WavEngine` (the default, exact for any vocoder: the pre-transformer keeps a KV
  cache per request, incremental.py) decodes each request's chunk on its own, one chunk per step,
  earliest playback deadline first (the NOTE below);
- `WindowCode2WavEngine` re-decodes a left context before every chunk (window.py: exact only while
  the context covers the vocoder's reach, the tiny checkpoint's, not the real 8-layer, window-72
  one) and batches: each step takes the oldest chunk of every request and decodes the windows of
  equal length together (after the first chunk nearly all windows are context + 25 frames, so
  they batch). With CUDA graphs (graphs.py) each group of windows is padded to a batch bucket and
  replayed from a graph captured per (window length, bucket).
Both derive from `Code2WavEngine`: a FIFO of received chunks per request, the input checks, and a
request's end (its decoder's tail, then `Decoded`). Qwen2.5-Omni's engine is token2wav_engine.py,
with the same inputs and events (below).

NOTE: why one chunk per step, by deadline. An incremental chunk is decoded on its own (batching
equal windows measured no gain: the convolutions are compute-bound), and a step's events reach
the handlers only when the step ends. Decoding every request's next chunk in one step made a new
request's first 4 frames (about 3.5 ms on the tiny checkpoint) wait for fifteen other requests'
25-frame chunks (about 40 ms each) before anyone heard it. So each step decodes one chunk: the
one of the request whose listener runs dry first, that is, before any audio the time it arrived
(a first chunk is always late), after it the time of its first audio plus the seconds of audio
it has had, less the time audio takes from here to the listener (`delivery_ms`: three hops
through the talker, thinker and router, tens of ms on a loaded CPU). A request that has audio in
hand waits; one about to underrun, or not yet heard, goes first. Its audio is handed up the moment
it is decoded. Without that margin a running request's chunk counted as due only once its
listener had already run dry, so during a burst it waited behind every new request's first chunk
(up to 180 ms in a probe at concurrency 16), the talker's early chunks too (chunking.py, "running
dry"): the two together cut underruns at 16; either alone did not (README, "Playback underruns").
"""

from __future__ import annotations

import abc
import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from services.code2wav.graphs import Code2WavGraphs
from services.code2wav.incremental import IncrementalDecoder
from services.code2wav.vocoder import VocoderGeometry, forward_batch, measure_geometry
from services.code2wav.window import WindowDecoder
from services.runtime.engine import EngineDefaults, StepResult
from services.runtime.events import EngineEvent
from services.runtime.settings import GraphSettings
from services.runtime.timing import ForwardTimer


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


@dataclass
class _State:
    decoder: WindowDecoder | IncrementalDecoder
    pending: deque = field(default_factory=deque)  # CodecChunk | CodecEnd, in arrival order
    added_at: float = field(default_factory=time.monotonic)
    first_audio_at: float | None = None  # monotonic time of its first audio (set by the incremental engine)

    def deadline(self, sample_rate: int, delivery_s: float) -> float:
        """When this request's next audio must leave here for its listener not to run dry (see the
        module note)."""
        if self.first_audio_at is None:
            return self.added_at
        return self.first_audio_at + self.decoder.samples_emitted / sample_rate - delivery_s


def check_frames(frames: torch.Tensor, groups: int, vocab: int) -> None:
    """A chunk's codes must be [n, groups] ids in [0, vocab) (the adapters check the wire's first)."""
    if frames.ndim != 2 or frames.shape[1] != groups:
        raise ValueError(f"codec frames must be [n, {groups}], got {list(frames.shape)}")
    if frames.numel() and (frames.min() < 0 or frames.max() >= vocab):
        raise ValueError(f"codec ids must be in [0, {vocab})")


class PendingRequests(EngineDefaults):
    """What every code2wav engine keeps: each request (`_requests`: request_id -> its state) holds
    the inputs not decoded yet in `pending`, and the load the loop reports is those queues."""

    _requests: dict

    def abort(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def has_work(self) -> bool:
        return any(r.pending for r in self._requests.values())

    @property
    def queue_depth(self) -> int:
        return sum(len(r.pending) for r in self._requests.values())

    @property
    def running(self) -> int:
        return len(self._requests)


class Code2WavEngine(PendingRequests, abc.ABC):
    """What both Qwen3-Omni engines share: per-request bookkeeping and a request's end. A subclass
    says which decoder a request gets (`new_decoder`) and what a step decodes (`step`)."""

    def __init__(self, model, config):
        self.model = model
        self.config = config
        self.timer = ForwardTimer()  # seconds in vocoder forwards (services/runtime/timing.py)
        self.geometry: VocoderGeometry = measure_geometry(model)
        self.codebook_size = int(config.code2wav_config.codebook_size)
        self.num_quantizers = int(config.code2wav_config.num_quantizers)
        self._requests: dict[str, _State] = {}  # request_id -> decoder state

    @abc.abstractmethod
    def new_decoder(self) -> WindowDecoder | IncrementalDecoder:
        """A new request's decoder state."""

    @abc.abstractmethod
    def step(self) -> StepResult:
        """Decode what is ready (the engine contract, services/runtime/engine.py)."""

    def add(self, request_id: str, _payload=None) -> None:
        self._requests[request_id] = _State(self.new_decoder())

    def add_input(self, request_id: str, payload: CodecChunk | CodecEnd) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        if isinstance(payload, CodecChunk):
            check_frames(payload.frames, self.num_quantizers, self.codebook_size)
        state.pending.append(payload)

    def _finish(self, request_id: str, state: _State) -> StepResult:
        """The request's end: the decoder's held-back tail, then Decoded; its state goes."""
        events: StepResult = []
        first = state.decoder.samples_emitted
        with self.timer:
            tail = state.decoder.finish()
        if tail.size:
            events.append((request_id, Audio(tail, first, state.decoder.frames_seen)))
        events.append((request_id, Decoded(state.decoder.samples_emitted, state.decoder.frames_seen)))
        del self._requests[request_id]
        return events


class IncrementalCode2WavEngine(Code2WavEngine):
    """One request's chunk a step, the earliest playback deadline first (the module note), through
    its `IncrementalDecoder`: every frame decoded once, exact for any vocoder. Eager: no CUDA graphs."""

    def __init__(self, model, config, delivery_ms: float = 100.0):
        super().__init__(model, config)
        self.delivery_s = delivery_ms / 1000  # audio's way from here to its listener (the module note)

    def new_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.model, self.geometry)

    def step(self) -> StepResult:
        """One chunk (or end) of the request with the earliest deadline; its audio goes up now."""
        request_id, state = self._most_due()
        item = state.pending.popleft()
        if isinstance(item, CodecEnd):
            return self._finish(request_id, state)
        if not item.frames.shape[0]:
            return []
        first = state.decoder.samples_emitted
        with self.timer:
            samples = state.decoder.push(item.frames)
        if not samples.size:
            return []
        if state.first_audio_at is None:
            state.first_audio_at = time.monotonic()
        return [(request_id, Audio(samples, first, state.decoder.frames_seen))]

    def _most_due(self) -> tuple[str, _State]:
        """The request with input waiting whose listener runs dry first."""
        rate = self.geometry.sample_rate
        return min(((r, s) for r, s in self._requests.items() if s.pending),
                   key=lambda item: item[1].deadline(rate, self.delivery_s))


class WindowCode2WavEngine(Code2WavEngine):
    """Every request's next chunk a step, each decoded with `left_context` frames before it
    (`WindowDecoder`), windows of equal length in one batched forward; from CUDA graphs
    (`Code2WavGraphs`) where enabled."""

    def __init__(self, model, config, left_context: int = 25, graphs: GraphSettings = GraphSettings(),
                 graph_windows: tuple[int, ...] = ()):
        super().__init__(model, config)
        self.left_context = left_context
        self.graphs = None
        # windows [G, n, Q] -> wav [G, n*U - L]: replayed graphs, or one eager forward.
        self.forward_windows = functools.partial(forward_batch, model)
        if graphs.enabled:
            self.graphs = Code2WavGraphs(model, graphs)
            self.graphs.capture(graph_windows, self.num_quantizers)
            self.forward_windows = self.graphs.decode

    def new_decoder(self) -> WindowDecoder:
        return WindowDecoder(self.model, self.geometry, self.left_context)

    def step(self) -> StepResult:
        """Every request's next pending item: ends first, then the chunks' windows, a batch per
        window length, each request's chunks in order."""
        events, groups = self._take_windows()
        for group in groups.values():
            events += self._decode(group)
        return events

    def _take_windows(self) -> tuple[StepResult, dict[int, list[tuple[str, torch.Tensor]]]]:
        """Pop every request's next item: the ends' events, and the chunks' windows grouped by
        length (window length -> [(request_id, window [n, Q])])."""
        events: StepResult = []
        groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for request_id, state in list(self._requests.items()):
            if not state.pending:
                continue
            item = state.pending.popleft()
            if isinstance(item, CodecEnd):
                events += self._finish(request_id, state)
            elif item.frames.shape[0]:
                window = state.decoder.window(item.frames)
                groups.setdefault(window.shape[0], []).append((request_id, window))
        return events, groups

    def _decode(self, group: list[tuple[str, torch.Tensor]]) -> StepResult:
        """One forward over windows of equal length; each request's decoder takes its row."""
        stacked = torch.stack([w for _, w in group])  # [G, n, Q]
        with self.timer:
            wavs = self.forward_windows(stacked)  # [G, n*U - L]
        events: StepResult = []
        for (request_id, window), wav in zip(group, wavs):
            decoder = self._requests[request_id].decoder
            first = decoder.samples_emitted
            samples = decoder.accept(window, wav)
            if samples.size:
                events.append((request_id, Audio(samples, first, decoder.frames_seen)))
        return events
