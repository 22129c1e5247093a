"""The code2wav engine for Qwen2.5-Omni: streaming Token2Wav over the stage's engine interface.

The same calls and events as Qwen3-Omni's engines (engine.py, `Code2WavEngine`), so the engine
loop and the servicer drive it unchanged: `add(request_id, Token2WavStart | None)`,
`add_input(request_id, CodecChunk | CodecEnd)` with frames [n, 1] (one codec token a frame),
`step() -> [(request_id, Audio | Decoded)]`, `abort`, `has_work`, `queue_depth`, `running`,
`geometry.samples_per_frame` (480 samples a token) and `geometry.sample_rate`, `num_quantizers` (1).
The server reaches it through qwen2_5_adapter.py.

Each step takes every request's oldest pending item (as the window engine does), then decodes
every DiT window that became ready (token2wav.py: they depend on tokens and noise only), windows
of equal length as one batch across requests, then every BigVGAN window that became ready, again
batched by length. After the first chunks nearly every DiT window is left + chunk + ahead tokens
long and every BigVGAN window chunk*r + 2*vocoder mel frames, so they batch.

Exact mode (`exact=True`, code2wav's `--exact-batching`, on by default on CPU) decodes every window
alone instead: one DiT ODE and one BigVGAN call per window, with the shape the window itself has,
so a window's bits cannot depend on what else was ready at that step, in this request or another.
That is what a migrated request's replay needs (services/serving/migration.py): a new replica
decodes the same windows at other steps, beside other requests, and must give the same audio bit
for bit. Batched windows differ in the last bits (the convolutions' and attention's reductions
follow the batch), so the replay check refused every replayed Qwen2.5-Omni request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.base.engine import EngineDefaults, StepResult
from services.base.timing import ForwardTimer
from services.code2wav.engine import Audio, CodecChunk, CodecEnd, Decoded, check_frames
from services.code2wav.token2wav import (
    DitWindow,
    Sampling,
    StreamContext,
    Token2WavRunner,
    Token2WavStream,
    VocoderWindow,
    Voice,
)
from services.runtime.model.device import device_clock


@dataclass(frozen=True)
class Token2WavStart:
    """What a request may choose; None keeps the engine's default (a fixed seed, so a replayed
    request decodes the same audio)."""

    voice: str | None = None
    seed: int | None = None


@dataclass
class _Request:
    stream: Token2WavStream
    voice: Voice
    pending: deque = field(default_factory=deque)  # CodecChunk | CodecEnd, in arrival order
    queued_tokens: int = 0  # tokens received by add_input, pending or pushed


class Token2WavEngine(EngineDefaults):
    def __init__(self, model, voices: dict[str, Voice], default_voice: str | None = None,
                 context: StreamContext = StreamContext(), sampling: Sampling = Sampling(), seed: int = 0,
                 max_batch: int = 16, exact: bool = False):
        if not voices:
            raise ValueError("token2wav needs at least one voice")
        self.runner = Token2WavRunner(model, sampling)
        self.geometry = self.runner.geometry
        self.voices = voices  # name -> conditioning
        self.default_voice = default_voice if default_voice is not None else next(iter(voices))
        if self.default_voice not in voices:
            raise ValueError(f"default voice {self.default_voice!r} is not one of {sorted(voices)}")
        self.context = context
        self.seed = seed
        self.max_batch = 1 if exact else max_batch  # exact: every window alone (the module's docstring)
        self.num_quantizers = 1
        # Seconds in DiT and BigVGAN forwards (services/base/timing.py), waiting for the GPU's kernels on cuda.
        self.timer = ForwardTimer(clock=device_clock(self.runner.device))
        self._requests: dict[str, _Request] = {}  # request_id -> its stream

    def add(self, request_id: str, payload: Token2WavStart | None = None) -> None:
        start = payload or Token2WavStart()
        name = start.voice or self.default_voice
        if name not in self.voices:
            raise ValueError(f"unknown voice {name!r}; expected one of {sorted(self.voices)}")
        seed = self.seed if start.seed is None else start.seed
        self._requests[request_id] = _Request(Token2WavStream(self.geometry, self.context, seed), self.voices[name])

    def add_input(self, request_id: str, payload) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        if isinstance(payload, CodecChunk):
            frames = payload.frames
            check_frames(frames, 1, self.geometry.num_embeds)
            request.queued_tokens += frames.shape[0]
            if request.queued_tokens * self.geometry.repeats > self.geometry.max_mel_frames:
                raise ValueError(f"more than {self.geometry.max_mel_frames // self.geometry.repeats} codec tokens")
        request.pending.append(payload)

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

    def step(self) -> StepResult:
        for request in self._requests.values():
            if request.pending:
                item = request.pending.popleft()
                if isinstance(item, CodecEnd):
                    request.stream.finish()
                elif item.frames.shape[0]:
                    request.stream.push(item.frames[:, 0])
        self._decode_mel()
        events = self._vocode()
        for request_id, request in list(self._requests.items()):
            if request.stream.done:
                events.append((request_id, Decoded(request.stream.samples_emitted, request.stream.received)))
                del self._requests[request_id]
        return events

    def _batched(self, items: list[tuple[object, DitWindow | VocoderWindow]], forward) -> list[tuple]:
        """(key, window) -> (key, window, output) in token order (`keep_start`): windows of equal
        length go through `forward([(key, window), ...])` together, at most `max_batch` at a time."""
        groups: dict[int, list] = {}  # window length -> (key, window)
        for key, window in items:
            groups.setdefault(window.end - window.start, []).append((key, window))
        results: list[tuple] = []
        for group in groups.values():
            for i in range(0, len(group), self.max_batch):
                batch = group[i:i + self.max_batch]
                with self.timer:
                    outputs = forward(batch)
                results.extend((key, window, out) for (key, window), out in zip(batch, outputs))
        return sorted(results, key=lambda item: item[1].keep_start)

    def _decode_mel(self) -> None:
        # Every ready DiT window of every request; equal lengths in one ODE. Each request's
        # windows are accepted in token order (a request's windows may fall in different groups).
        windows = [(request, window) for request in self._requests.values() for window in request.stream.dit_windows()]
        mels = self._batched(windows, lambda batch: self.runner.sample_mel([w for _, w in batch], [r.voice for r, _ in batch]))
        for request, window, mel in mels:
            request.stream.accept_mel(window, mel)

    def _vocode(self) -> StepResult:
        windows = [(request_id, window) for request_id, request in self._requests.items()
                   for window in request.stream.vocoder_windows()]
        wavs = self._batched(windows, lambda batch: self.runner.vocode([w for _, w in batch]))
        events: StepResult = []
        for request_id, window, wav in wavs:
            stream = self._requests[request_id].stream
            first = stream.samples_emitted
            samples = stream.accept_audio(window, wav)
            if samples.size:
                events.append((request_id, Audio(samples, first)))
        return events
