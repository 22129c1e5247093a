"""The systems under test, each run as one block: a list of prompts at a fixed concurrency.

- `pipeline`: the router's `Generate`, streamed. Concurrency N = N client threads, each sending
  its next request when its previous one ended (closed loop), over one gRPC channel.
- `reference`: transformers' `generate` one request at a time, as a server that wraps it would:
  the same N client threads in front of one generate at a time (first come, first served), so a
  request's latency includes its wait for the requests ahead of it.
- `reference-batched`: `generate` over batches of N requests sent together; every request of a
  batch gets its text and audio when the batch ends.

Nothing is streamed by `generate`, so for both reference systems TTFT = TTFP = the time to the
whole response.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from bench.loop import closed_loop
from bench.metrics import RequestTiming, whole_response
from bench.prompts import BenchPrompt
from bench.reference import Generated, Reference
from services.tools.client import build_request, collect, connect


class System(enum.Enum):
    REFERENCE = "reference"
    REFERENCE_BATCHED = "reference-batched"
    PIPELINE = "pipeline"
    PIPELINE_UNBATCHED = "pipeline-unbatched"  # the same stack, thinker and talker at --max-batch-size 1


@dataclass(frozen=True)
class Outcome:
    timing: RequestTiming | None  # None when the request failed
    text_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class RequestRecord:
    system: System
    concurrency: int
    round: int
    prompt_index: int
    outcome: Outcome


@dataclass(frozen=True)
class BlockResult:
    outcomes: list[Outcome]  # in the order of the block's prompts
    wall_s: float  # first send to last completion


def run_closed_loop(items: list, concurrency: int, call: Callable[[object], Outcome],
                    on_done: Callable[[Outcome], None] = lambda _: None) -> BlockResult:
    """`concurrency` threads take the next item as soon as their previous call returned."""
    outcomes, wall = closed_loop(items, concurrency, call,
                                 lambda exc: Outcome(None, error=f"{type(exc).__name__}: {exc}"), on_done)
    return BlockResult(outcomes=outcomes, wall_s=wall)


class PipelineSystem:
    """Requests through the router; request messages are built before the clock starts."""

    def __init__(self, target: str, voice: str | None, max_new_tokens: int, talker_max_new_tokens: int,
                 timeout_s: float):
        self.channel, self.stub = connect(target)
        self.voice = voice
        self.max_new_tokens = max_new_tokens
        self.talker_max_new_tokens = talker_max_new_tokens
        self.timeout_s = timeout_s

    def request(self, prompt: BenchPrompt):
        return build_request(prompt.text, prompt.system, prompt.audio, prompt.image, self.voice,
                             max_new_tokens=self.max_new_tokens, talker_max_new_tokens=self.talker_max_new_tokens)

    def call(self, request) -> Outcome:
        try:
            result = collect(self.stub, request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            return Outcome(None, error=f"{exc.code().name}: {exc.details()}")
        done = time.perf_counter()
        rel = lambda times: tuple(t - result.sent for t in times)  # noqa: E731
        timing = RequestTiming(
            text_times=rel(result.text_times), audio_times=rel(result.audio_times),
            audio_durations=tuple(c.size / result.sample_rate for c in result.audio_chunks), done=done - result.sent,
        )
        return Outcome(timing, text_tokens=len(result.thinker_token_ids))

    def run(self, prompts: list[BenchPrompt], concurrency: int, on_done=lambda _: None) -> BlockResult:
        return run_closed_loop([self.request(p) for p in prompts], concurrency, self.call, on_done)

    def close(self) -> None:
        self.channel.close()


class ReferenceSystem:
    """One generate at a time behind `concurrency` clients, first come first served."""

    def __init__(self, reference: Reference):
        self.reference = reference
        # One worker with a FIFO queue: a server that wraps generate without batching.
        self.server = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference")

    def _serve(self, prompt: BenchPrompt) -> tuple[float, float, Generated]:
        started = time.perf_counter()
        generated = self.reference.generate([prompt])[0]
        return started, time.perf_counter() - started, generated

    def call(self, prompt: BenchPrompt) -> Outcome:
        sent = time.perf_counter()
        started, wall, generated = self.server.submit(self._serve, prompt).result()
        return Outcome(whole_response(wall, generated.audio_seconds, wait_s=started - sent), generated.text_tokens)

    def run(self, prompts: list[BenchPrompt], concurrency: int, on_done=lambda _: None) -> BlockResult:
        return run_closed_loop(prompts, concurrency, self.call, on_done)

    def close(self) -> None:
        self.server.shutdown()


class BatchedReferenceSystem:
    """Batches of `concurrency` requests, one generate each."""

    def __init__(self, reference: Reference):
        self.reference = reference

    def run(self, prompts: list[BenchPrompt], concurrency: int, on_done=lambda _: None) -> BlockResult:
        outcomes: list[Outcome] = []
        start = time.perf_counter()
        for first in range(0, len(prompts), concurrency):
            batch = prompts[first:first + concurrency]
            sent = time.perf_counter()
            try:
                generated = self.reference.generate(batch)
                wall = time.perf_counter() - sent
                done = [Outcome(whole_response(wall, g.audio_seconds), g.text_tokens) for g in generated]
            except Exception as exc:
                done = [Outcome(None, error=f"{type(exc).__name__}: {exc}")] * len(batch)
            for outcome in done:
                outcomes.append(outcome)
                on_done(outcome)
        return BlockResult(outcomes=outcomes, wall_s=time.perf_counter() - start)
