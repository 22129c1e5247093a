"""The compute floor of the first audio chunk, timed in-process on the same modules.

What must be computed before a client can hear anything, one step after the other with no
service, queue or network between them, driven through the services' own engines of the
checkpoint's family (services/tools/inprocess.py, `Handoff`: the servers' own adapters):

1. thinker: prefill + the first token (the engine's prefill step);
2. thinker: the further tokens the first chunk needs. Qwen3-Omni: frame f > 0 consumes text row
   f, so a first chunk of 4 frames needs 4 tokens unless the text ends first. Qwen2.5-Omni: the
   talker starts on reply part 0, which comes with token 1, and frame f needs reply part f, so 4
   frames need 5 tokens;
3. talker: prefill + frame 0, then decode steps to `first_chunk_frames` frames;
4. code2wav: those frames into the engine the code2wav service builds, through the family's
   adapter (services/code2wav/server.py, `ADAPTERS`; the service's default config), as a new
   request's first input, to its first audio (`Code2WavFloor`; Qwen3-Omni: the incremental
   engine on the first chunk; Qwen2.5-Omni: streaming Token2Wav, whose first audio needs a chunk
   plus its look-ahead of tokens (`--token2wav-context`, 24 + 48 by default), so the talker part
   of its floor runs to that many frames: `frames_to_first_audio`).

TTFP / floor is then the cost of serving: processes, gRPC hops, queueing and scheduling. The
floor excludes prompt building (tokenizer, audio features, image patches), reported apart as
`prompt_ms`, though the pipeline's TTFP includes it.

The burst floor (`FloorMeter.measure_burst`) is the same for n requests that arrive together:
the same engines batch them as the services do (default engine settings: one prefill per step
beside the decode batch), stepped one after the other on one thread, each request's first chunk
vocoded the moment it is complete. Its median is what TTFP at concurrency n cannot go below
on one core without serving overhead (the pipeline has its stages on separate cores, so it could
overlap them), which says how much of TTFP at n is the compute of the other requests ahead.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from bench.prompts import BenchPrompt
from omni.v1 import stages_pb2
from services.base.stages import Stage
from services.code2wav.config import Code2WavConfig
from services.code2wav.engine import Audio, CodecChunk, CodecEnd
from services.code2wav.server import ADAPTERS
from services.runtime.inputs.prompt import PromptBuilder
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import LoadedStage
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from services.talker.engine_base import Frame, TalkerDone
from services.thinker.engine import Token
from services.tools.inprocess import Handoff
from services.tools.reference import ReferenceRunner

TALKER_REPETITION_PENALTY = 1.05  # the talker service's default, as in generate


@dataclass(frozen=True)
class FloorSample:
    prompt_index: int
    prompt_ms: float  # building the model inputs; not part of the floor
    thinker_prefill_ms: float  # prefill + first token
    thinker_decode_ms: float  # tokens 2.. that the first chunk's frames consume
    talker_prefill_ms: float  # text projection + prefill + frame 0
    talker_decode_ms: float  # frames 1..n-1
    code2wav_ms: float  # the first chunk to its first audio (`Code2WavFloor.first_audio`)
    thinker_tokens: int
    frames: int

    @property
    def total_ms(self) -> float:
        return (self.thinker_prefill_ms + self.thinker_decode_ms + self.talker_prefill_ms
                + self.talker_decode_ms + self.code2wav_ms)


@dataclass(frozen=True)
class FloorSummary:
    """Medians over all samples; `floor_ms` is the median total, the TTFP denominator."""

    floor_ms: float
    min_ms: float
    prompt_ms: float
    thinker_prefill_ms: float
    thinker_decode_ms: float
    talker_prefill_ms: float
    talker_decode_ms: float
    code2wav_ms: float
    first_chunk_frames: int
    samples: list[FloorSample]


@dataclass(frozen=True)
class FirstChunk:
    """What the thinker and talker did before the first chunk, and the chunk."""

    prompt_ms: float
    thinker_prefill_ms: float
    thinker_decode_ms: float
    talker_prefill_ms: float
    talker_decode_ms: float
    thinker_tokens: int
    chunk: torch.Tensor | None  # [frames, num_code_groups]; None when the talker made no frame


class Code2WavFloor:
    """Step 4 of the floor: the code2wav engine of the checkpoint's family, built by its adapter as
    the service builds it (the service's default config), beside the reference's other stages; each
    request starts as the talker starts it (`Code2WavStart` with the request's voice)."""

    def __init__(self, runner: ReferenceRunner, device: str, voice: str | None, left_context: int = 25):
        adapter_cls = ADAPTERS[runner.family]
        loaded = LoadedStage(Stage.CODE2WAV, adapter_cls.stage_of(runner.model), runner.config, runner.family)
        config = Code2WavConfig(serving=ServingConfig(), model=ModelConfig(checkpoint=str(runner.folder), device=device),
                                left_context=left_context)
        self.adapter = adapter_cls(loaded, config)
        self.engine = self.adapter.build_engine()
        self.job = self.adapter.job_from_proto(stages_pb2.Code2WavStart(voice=voice or ""))

    def admit(self, request_id: str) -> None:
        self.engine.add(request_id, self.job)

    def first_audio(self, request_id: str, chunk: torch.Tensor) -> None:
        """A new request's first frames [n, num_code_groups] decoded to its first audio: what the floor
        times. A request with no more frames than these and fewer than the decoder's look-ahead hears
        its first audio when it ends: the stream flushes then."""
        self.engine.add_input(request_id, CodecChunk(chunk))
        if not any(isinstance(event, Audio) for _, event in self.engine.step()):
            self.engine.add_input(request_id, CodecEnd())
            self.engine.step()

    def release(self, request_id: str) -> None:
        self.engine.abort(request_id)


class LMFloor:
    """Steps 1-3 of the floor: the family's thinker and talker engines, in-process, to the first chunk."""

    def __init__(self, runner: ReferenceRunner, device: str, voice: str | None, max_new_tokens: int,
                 talker_max_new_tokens: int, first_chunk_frames: int = 4):
        model, config = runner.model, runner.config
        self.prompts = PromptBuilder(runner.folder, config)
        self.device = device
        self.handoff = Handoff(self.prompts, config)
        self.voice = voice
        self.thinker = self.handoff.thinker_engine(model.thinker, config, device=device)
        self.talker = self.handoff.talker_engine(model.talker, config, device=device)
        self.max_new_tokens = max_new_tokens
        self.talker_max_new_tokens = talker_max_new_tokens
        self.first_chunk_frames = first_chunk_frames

    def thinker_job(self, inputs):
        return self.handoff.thinker_job(inputs, SamplingConfig(max_new_tokens=self.max_new_tokens), self.voice)

    def talker_job(self, prefilled, job):
        """The talker's job as the thinker service starts it (the talker service's sampling defaults)."""
        return self.handoff.talker_job(prefilled, job, SamplingConfig(
            max_new_tokens=self.talker_max_new_tokens, repetition_penalty=TALKER_REPETITION_PENALTY), self.voice)

    def clock(self) -> float:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter()

    def measure(self, prompt: BenchPrompt, prompt_index: int = 0) -> FirstChunk:
        rid = f"floor-{prompt_index}"
        t = self.clock()
        inputs = self.prompts.build(prompt.messages())
        prompt_ms = (self.clock() - t) * 1000
        spent = {"thinker_prefill": 0.0, "thinker_decode": 0.0, "talker_prefill": 0.0, "talker_decode": 0.0}

        def timed(bucket: str, fn, *args):
            start = self.clock()
            result = fn(*args)
            spent[bucket] += (self.clock() - start) * 1000
            return result

        tokens: list[Token] = []
        frames: list[torch.Tensor] = []  # [num_code_groups] each
        talker_done = False

        def feed(events, talker_bucket: str) -> None:
            # As the thinker service does: what each token brings the talker (the family's handoff).
            for _, event in events:
                if isinstance(event, Token):
                    previous = tokens[-1].token_id if tokens else None
                    tokens.append(event)
                    for payload in self.handoff.talker_inputs(event, previous):
                        timed(talker_bucket, self.talker.add_input, rid, payload)

        def take(events) -> None:
            nonlocal talker_done
            for _, event in events:
                if isinstance(event, Frame):
                    frames.append(event.codes)
                elif isinstance(event, TalkerDone):
                    talker_done = True

        try:
            job = self.thinker_job(inputs)
            self.thinker.add(rid, job)
            events = timed("thinker_prefill", self.thinker.step)
            prefilled = next(e for _, e in events if isinstance(e, self.handoff.prefilled))
            self.talker.add(rid, self.talker_job(prefilled, job))
            feed(events, "talker_prefill")
            while len(frames) < self.first_chunk_frames and not talker_done:
                if self.talker.has_work():
                    take(timed("talker_prefill" if not frames else "talker_decode", self.talker.step))
                elif self.thinker.has_work():
                    # Before frame 0 (Qwen2.5-Omni: reply part 0 comes with token 1) the input is the prefill's.
                    feed(timed("thinker_decode", self.thinker.step), "talker_prefill" if not frames else "talker_decode")
                else:
                    break
        finally:
            self.thinker.abort(rid)
            self.talker.abort(rid)
        return FirstChunk(
            prompt_ms=prompt_ms, thinker_prefill_ms=spent["thinker_prefill"], thinker_decode_ms=spent["thinker_decode"],
            talker_prefill_ms=spent["talker_prefill"], talker_decode_ms=spent["talker_decode"],
            thinker_tokens=len(tokens),
            chunk=torch.stack(frames[:self.first_chunk_frames]) if frames else None,
        )


class FloorMeter:
    """The whole floor: `LMFloor`, then the family's code2wav on the first chunk."""

    def __init__(self, runner: ReferenceRunner, device: str, voice: str | None, max_new_tokens: int,
                 talker_max_new_tokens: int, first_chunk_frames: int = 4, left_context: int = 25):
        self.code2wav = Code2WavFloor(runner, device, voice, left_context)
        first_audio_frames = self.code2wav.adapter.frames_to_first_audio(first_chunk_frames)
        self.lms = LMFloor(runner, device, voice, max_new_tokens, talker_max_new_tokens, first_audio_frames)

    def measure(self, prompt: BenchPrompt, prompt_index: int = 0) -> FloorSample:
        first = self.lms.measure(prompt, prompt_index)
        code2wav_ms = 0.0
        if first.chunk is not None:
            rid = f"floor-{prompt_index}"
            self.code2wav.admit(rid)
            try:
                start = self.lms.clock()
                self.code2wav.first_audio(rid, first.chunk)
                code2wav_ms = (self.lms.clock() - start) * 1000
            finally:
                self.code2wav.release(rid)
        return FloorSample(
            prompt_index=prompt_index, prompt_ms=first.prompt_ms,
            thinker_prefill_ms=first.thinker_prefill_ms, thinker_decode_ms=first.thinker_decode_ms,
            talker_prefill_ms=first.talker_prefill_ms, talker_decode_ms=first.talker_decode_ms,
            code2wav_ms=code2wav_ms, thinker_tokens=first.thinker_tokens,
            frames=0 if first.chunk is None else first.chunk.shape[0],
        )


    def measure_burst(self, prompts: list[BenchPrompt]) -> list[float]:
        """ms from the burst's arrival to each request's first audio (sorted); see the module note."""
        lms = self.lms
        handoff, thinker, talker = lms.handoff, lms.thinker, lms.talker
        inputs = {f"burst-{i}": lms.prompts.build(p.messages()) for i, p in enumerate(prompts)}  # not timed
        frames: dict[str, list[torch.Tensor]] = {rid: [] for rid in inputs}
        first_audio: dict[str, float] = {}
        ended: set[str] = set()  # no audio to make (the talker ended before a frame)
        jobs, previous = {}, {}  # request_id -> its thinker job, its last text id
        start = lms.clock()
        try:
            for rid, prompt in inputs.items():
                jobs[rid] = lms.thinker_job(prompt)
                thinker.add(rid, jobs[rid])
            while len(first_audio) + len(ended) < len(inputs) and (thinker.has_work() or talker.has_work()):
                if thinker.has_work():
                    events = thinker.step()
                    for rid, event in events:  # every prefilled request joins the talker before its first row
                        if isinstance(event, handoff.prefilled):
                            talker.add(rid, lms.talker_job(event, jobs[rid]))
                    for rid, event in events:
                        if isinstance(event, Token):
                            for payload in handoff.talker_inputs(event, previous.get(rid)):
                                talker.add_input(rid, payload)
                            previous[rid] = event.token_id
                if talker.has_work():
                    for rid, event in talker.step():
                        if rid in first_audio or rid in ended:
                            continue
                        if isinstance(event, Frame):
                            frames[rid].append(event.codes)
                        done = isinstance(event, TalkerDone)
                        if len(frames[rid]) >= lms.first_chunk_frames or (done and frames[rid]):
                            self.code2wav.admit(rid)
                            self.code2wav.first_audio(rid, torch.stack(frames[rid][:lms.first_chunk_frames]))
                            self.code2wav.release(rid)
                            first_audio[rid] = (lms.clock() - start) * 1000
                        elif done:
                            ended.add(rid)
        finally:
            for rid in inputs:
                thinker.abort(rid)
                talker.abort(rid)
        return sorted(first_audio.values())


def summarize_floor(samples: list[FloorSample], first_chunk_frames: int) -> FloorSummary:
    med = lambda f: statistics.median(f(s) for s in samples)  # noqa: E731
    return FloorSummary(
        floor_ms=med(lambda s: s.total_ms), min_ms=min(s.total_ms for s in samples),
        prompt_ms=med(lambda s: s.prompt_ms), thinker_prefill_ms=med(lambda s: s.thinker_prefill_ms),
        thinker_decode_ms=med(lambda s: s.thinker_decode_ms), talker_prefill_ms=med(lambda s: s.talker_prefill_ms),
        talker_decode_ms=med(lambda s: s.talker_decode_ms), code2wav_ms=med(lambda s: s.code2wav_ms),
        first_chunk_frames=first_chunk_frames, samples=samples,
    )
