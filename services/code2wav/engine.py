"""The code2wav engine: decodes the codec chunks that are ready.

Two decoders (`--decoder`): "incremental" (the default, exact for any vocoder: the
pre-transformer keeps a KV cache per request, see incremental.py) decodes each request's chunk
on its own, one chunk per step, earliest playback deadline first (below); "window" re-decodes
a left context before every chunk (exact only while the context covers the vocoder's reach: the
tiny checkpoint, not the real 8-layer, window-72 one) and batches.

With "window", each request owns a `StreamingDecoder` (left context + held-back tail, see
streaming.py); the engine keeps a FIFO of received chunks per request; each step takes the oldest
chunk of every request and decodes the windows of equal length together (after the first chunk nearly all
windows are context + 25 frames, so they batch). With CUDA graphs (`Code2WavGraphs`) each group
of windows is padded to a batch bucket and replayed from a graph captured per (window length,
bucket): window lengths are few (first chunk, first + context, context + chunk, and the tails).

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

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from services.code2wav.incremental import IncrementalDecoder
from services.code2wav.streaming import (
    StreamingDecoder,
    VocoderGeometry,
    forward_batch,
    measure_geometry,
)
from services.runtime.cuda_graphs import GraphRunner, pad_rows, plan_padding
from services.runtime.engine import EngineDefaults, StepResult
from services.runtime.events import EngineEvent
from services.runtime.settings import GraphSettings
from services.runtime.timing import ForwardTimer

log = logging.getLogger(__name__)


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
    decoder: StreamingDecoder | IncrementalDecoder
    pending: deque = field(default_factory=deque)  # CodecChunk | CodecEnd, in arrival order
    added_at: float = field(default_factory=time.monotonic)
    first_audio_at: float | None = None  # monotonic time of its first audio

    def deadline(self, sample_rate: int, delivery_s: float) -> float:
        """When this request's next audio must leave here for its listener not to run dry (see the
        module note)."""
        if self.first_audio_at is None:
            return self.added_at
        return self.first_audio_at + self.decoder.samples_emitted / sample_rate - delivery_s


class Code2WavGraphs:
    """Vocoder forwards of [B, n, Q] windows, replayed from a graph per (n, bucket)."""

    def __init__(self, model, settings: GraphSettings, max_graphs: int = 96):
        self.model = model
        self.settings = settings
        self.device = next(model.parameters()).device
        self.runner = GraphRunner(self._forward, settings.enabled, "code2wav", max_graphs=max_graphs)

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


class Code2WavEngine(EngineDefaults):
    def __init__(self, model, config, left_context: int = 25, graphs: GraphSettings = GraphSettings(),
                 graph_windows: tuple[int, ...] = (), decoder: str = "incremental", delivery_ms: float = 100.0):
        if decoder not in ("incremental", "window"):
            raise ValueError(f"decoder must be incremental or window, got {decoder!r}")
        self.model = model
        self.config = config
        self.timer = ForwardTimer()  # seconds in vocoder forwards (services/runtime/timing.py)
        self.left_context = left_context
        self.decoder = decoder
        self.delivery_s = delivery_ms / 1000  # audio's way from here to its listener (the module note)
        self.geometry: VocoderGeometry = measure_geometry(model)
        self.graphs = None
        if graphs.enabled:
            self.graphs = Code2WavGraphs(model, graphs)
            self.graphs.capture(graph_windows, int(config.code2wav_config.num_quantizers))
        self.codebook_size = int(config.code2wav_config.codebook_size)
        self.num_quantizers = int(config.code2wav_config.num_quantizers)
        self._states: dict[str, _State] = {}  # request_id -> decoder state

    def add(self, request_id: str, _payload=None) -> None:
        decoder = (IncrementalDecoder(self.model, self.geometry) if self.decoder == "incremental"
                   else StreamingDecoder(self.model, self.geometry, self.left_context))
        self._states[request_id] = _State(decoder)

    def add_input(self, request_id: str, payload) -> None:
        state = self._states.get(request_id)
        if state is None:
            return
        if isinstance(payload, CodecChunk):
            frames = payload.frames
            if frames.ndim != 2 or frames.shape[1] != self.num_quantizers:
                raise ValueError(f"codec frames must be [n, {self.num_quantizers}], got {list(frames.shape)}")
            if frames.numel() and (frames.min() < 0 or frames.max() >= self.codebook_size):
                raise ValueError(f"codec ids must be in [0, {self.codebook_size})")
        state.pending.append(payload)

    def abort(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def has_work(self) -> bool:
        return any(s.pending for s in self._states.values())

    @property
    def queue_depth(self) -> int:
        return sum(len(s.pending) for s in self._states.values())

    @property
    def running(self) -> int:
        return len(self._states)

    def step(self) -> StepResult:
        if self.decoder == "incremental":
            return self._step_incremental()
        # Take every request's next pending item; decode all chunk windows of equal length in
        # one forward (a batch), each request's chunks in order.
        events: StepResult = []
        windows: dict[int, list[tuple[str, torch.Tensor]]] = {}  # window length -> [(request_id, window)]
        for request_id, state in list(self._states.items()):
            if not state.pending:
                continue
            item = state.pending.popleft()
            if isinstance(item, CodecEnd):
                events += self._finish(request_id, state)
            elif item.frames.shape[0]:
                window = state.decoder.window(item.frames)
                windows.setdefault(window.shape[0], []).append((request_id, window))
        for group in windows.values():
            stacked = torch.stack([w for _, w in group])  # [G, n, Q]
            with self.timer:
                wavs = self.graphs.decode(stacked) if self.graphs is not None else forward_batch(self.model, stacked)
            for (request_id, window), wav in zip(group, wavs):
                decoder = self._states[request_id].decoder
                first = decoder.samples_emitted
                samples = decoder.accept(window, wav)
                if samples.size:
                    events.append((request_id, Audio(samples, first, decoder.frames_seen)))
        return events

    def _step_incremental(self) -> StepResult:
        """One chunk (or end) of the request with the earliest deadline; its audio goes up now."""
        rate = self.geometry.sample_rate
        request_id, state = min(((r, s) for r, s in self._states.items() if s.pending),
                                key=lambda item: item[1].deadline(rate, self.delivery_s))
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

    def _finish(self, request_id: str, state: _State) -> StepResult:
        """The request's end: the decoder's held-back tail, then Decoded; its state goes."""
        events: StepResult = []
        first = state.decoder.samples_emitted
        with self.timer:
            tail = state.decoder.finish()
        if tail.size:
            events.append((request_id, Audio(tail, first, state.decoder.frames_seen)))
        events.append((request_id, Decoded(state.decoder.samples_emitted, state.decoder.frames_seen)))
        del self._states[request_id]
        return events
