"""The compute floor of the first audio chunk, timed in-process on the same modules.

What must be computed before a client can hear anything, one step after the other with no
service, queue or network between them, driven through the services' own engines:

1. thinker: prefill + the first token (`ThinkerEngine` prefill step);
2. thinker: the further tokens the first chunk needs (frame f > 0 consumes text row f, so a
   first chunk of 4 frames needs 4 tokens unless the text ends first);
3. talker: text projections, prefill + frame 0, then decode steps to `first_chunk_frames` frames;
4. code2wav: one `StreamingDecoder.push` of those frames.

TTFP / floor is then the cost of serving: processes, gRPC hops, queueing and scheduling. The
floor excludes prompt building (tokenizer, audio features, image patches), reported apart as
`prompt_ms`, though the pipeline's TTFP includes it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from bench.prompts import BenchPrompt
from services.code2wav.streaming import StreamingDecoder, measure_geometry
from services.runtime.prompt import PromptBuilder, resolve_voice
from services.runtime.sampling import SamplingConfig
from services.talker.engine import (
    Frame,
    TalkerDone,
    TalkerEngine,
    TextEnd,
    TextRow,
)
from services.thinker.engine import Prefilled, ThinkerEngine, ThinkerJob, Token
from services.tools.inprocess import talker_job
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
    code2wav_ms: float  # one push of the chunk
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


class FloorMeter:
    def __init__(self, runner: ReferenceRunner, device: str, voice: str | None, max_new_tokens: int,
                 talker_max_new_tokens: int, first_chunk_frames: int = 4, left_context: int = 25):
        model, config = runner.model, runner.config
        self.prompts = PromptBuilder(runner.folder, config)
        self.device = device
        self.thinker = ThinkerEngine(model.thinker, config, device=device)
        self.talker = TalkerEngine(model.talker, config, device=device)
        self.vocoder = model.code2wav
        self.geometry = measure_geometry(model.code2wav)
        self.left_context = left_context
        _, self.speaker_id = resolve_voice(config, voice)
        self.max_new_tokens = max_new_tokens
        self.talker_max_new_tokens = talker_max_new_tokens
        self.first_chunk_frames = first_chunk_frames

    def _clock(self) -> float:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter()

    def measure(self, prompt: BenchPrompt, prompt_index: int = 0) -> FloorSample:
        rid = f"floor-{prompt_index}"
        t = self._clock()
        inputs = self.prompts.build(prompt.messages())
        prompt_ms = (self._clock() - t) * 1000
        spent = {"thinker_prefill": 0.0, "thinker_decode": 0.0, "talker_prefill": 0.0, "talker_decode": 0.0}

        def timed(bucket: str, fn, *args):
            start = self._clock()
            result = fn(*args)
            spent[bucket] += (self._clock() - start) * 1000
            return result

        tokens: list[Token] = []
        frames: list[torch.Tensor] = []  # [num_code_groups] each
        talker_done = False

        def feed(events, talker_bucket: str) -> None:
            # As the thinker service does: a text row per token except the last, then the end mark.
            for _, event in events:
                if isinstance(event, Token):
                    tokens.append(event)
                    payload = TextEnd() if event.last else TextRow(event.embedding)
                    timed(talker_bucket, self.talker.add_input, rid, payload)

        def take(events) -> None:
            nonlocal talker_done
            for _, event in events:
                if isinstance(event, Frame):
                    frames.append(event.codes)
                elif isinstance(event, TalkerDone):
                    talker_done = True

        try:
            self.thinker.add(rid, ThinkerJob(inputs, SamplingConfig(max_new_tokens=self.max_new_tokens), True))
            events = timed("thinker_prefill", self.thinker.step)
            prefilled = next(e for _, e in events if isinstance(e, Prefilled))
            self.talker.add(rid, talker_job(prefilled, inputs, self.speaker_id,
                                            SamplingConfig(max_new_tokens=self.talker_max_new_tokens,
                                                           repetition_penalty=TALKER_REPETITION_PENALTY)))
            feed(events, "talker_prefill")
            while len(frames) < self.first_chunk_frames and not talker_done:
                if self.talker.has_work():
                    take(timed("talker_prefill" if not frames else "talker_decode", self.talker.step))
                elif self.thinker.has_work():
                    feed(timed("thinker_decode", self.thinker.step), "talker_decode")
                else:
                    break
            chunk = torch.stack(frames[:self.first_chunk_frames]) if frames else None  # [n, num_code_groups]
            code2wav_ms = 0.0
            if chunk is not None:
                decoder = StreamingDecoder(self.vocoder, self.geometry, self.left_context)
                start = self._clock()
                decoder.push(chunk)
                code2wav_ms = (self._clock() - start) * 1000
        finally:
            self.thinker.abort(rid)
            self.talker.abort(rid)
        return FloorSample(
            prompt_index=prompt_index, prompt_ms=prompt_ms,
            thinker_prefill_ms=spent["thinker_prefill"], thinker_decode_ms=spent["thinker_decode"],
            talker_prefill_ms=spent["talker_prefill"], talker_decode_ms=spent["talker_decode"],
            code2wav_ms=code2wav_ms, thinker_tokens=len(tokens), frames=min(len(frames), self.first_chunk_frames),
        )


def summarize_floor(samples: list[FloorSample], first_chunk_frames: int) -> FloorSummary:
    med = lambda f: statistics.median(f(s) for s in samples)  # noqa: E731
    return FloorSummary(
        floor_ms=med(lambda s: s.total_ms), min_ms=min(s.total_ms for s in samples),
        prompt_ms=med(lambda s: s.prompt_ms), thinker_prefill_ms=med(lambda s: s.thinker_prefill_ms),
        thinker_decode_ms=med(lambda s: s.thinker_decode_ms), talker_prefill_ms=med(lambda s: s.talker_prefill_ms),
        talker_decode_ms=med(lambda s: s.talker_decode_ms), code2wav_ms=med(lambda s: s.code2wav_ms),
        first_chunk_frames=first_chunk_frames, samples=samples,
    )
