"""Figures: docs/performance.md, "Admission: a burst in one step, a long prompt in chunks". Rerun:
`.venv/bin/python -m bench.probes.admission [checkpoint]` (default models/tiny-qwen3-omni; `make
bench-wide` generates models/wide-qwen3-omni).

The thinker engine alone, in-process, one torch thread, exact batching off (the mode that packs and
chunks). Two measurements, the engines compared alternating in one run:

- a burst: 16 text prompts arrive at once; the steps until every one has its first token and the
  time that takes (the 16th request's TTFT), admitted one prompt a step (`--max-prefills-per-step
  1`, the old default) against all in one packed forward (the default);
- a long prompt among running streams: 4 requests decoding when a prompt of about 3,000 tokens
  arrives; the longest wait between two tokens of a running request (the stall the long prefill
  puts on every stream) and the long prompt's own time to first token, for a step's token budget of
  none (the whole prompt in one step) against 2,048 (the default) and 512.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from omni.v1 import omni_pb2
from services.base.families import family_of
from services.runtime.inputs.prompt import PromptBuilder
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import Stage, load_stage
from services.thinker.admission import messages_from_proto
from services.thinker.engine import ThinkerEngineConfig, Token
from services.thinker.server import ADAPTERS

REPEATS = 3
BURST = 16
RUNNING = 4


class Thinker:
    def __init__(self, checkpoint: str):
        self.loaded = load_stage(checkpoint, Stage.THINKER)
        self.builder = PromptBuilder(checkpoint, self.loaded.config)
        self.adapter = ADAPTERS[family_of(checkpoint)](checkpoint, self.loaded.config, self.builder)

    def engine(self, prefills: int, budget: int):
        config = ThinkerEngineConfig(max_batch_size=32, num_slots=32, max_model_len=4096, exact_batching=False,
                                     max_prefills_per_step=prefills, max_prefill_tokens=budget)
        return self.adapter.engine(self.loaded.model, self.loaded.config, engine_config=config)

    def job(self, text: str, max_new_tokens: int):
        request = omni_pb2.GenerateRequest()
        request.messages.add(role=omni_pb2.ROLE_USER).content.add(text=text)
        prompt = self.builder.build(messages_from_proto(request))
        return self.adapter.job(prompt, SamplingConfig(max_new_tokens=max_new_tokens), False, (),
                                self.adapter.resolve_voice(None)), prompt.num_tokens


def burst(thinker: Thinker, prefills: int, salt: int) -> tuple[int, float]:
    """(steps, seconds) until each of BURST prompts arriving together has its first token."""
    engine = thinker.engine(prefills, 2048)
    waiting = set()
    for i in range(BURST):
        job, _ = thinker.job(f"Request {salt}-{i}: tell me something about the number {i}.", 8)
        engine.add(f"r{i}", job)
        waiting.add(f"r{i}")
    steps, began = 0, time.perf_counter()
    while waiting:
        steps += 1
        waiting -= {rid for rid, event in engine.step() if isinstance(event, Token)}
    return steps, time.perf_counter() - began


def long_prompt(thinker: Thinker, budget: int, text: str) -> tuple[float, float, int]:
    """(longest wait between two tokens of a running request, the long prompt's TTFT, its tokens)."""
    engine = thinker.engine(0, budget)
    for i in range(RUNNING):
        engine.add(f"run{i}", thinker.job(f"Stream {i}: count slowly.", 400)[0])
    engine.step()  # every running request prefilled and decoding
    last = {f"run{i}": time.perf_counter() for i in range(RUNNING)}
    job, tokens = thinker.job(text, 4)
    arrived = time.perf_counter()
    engine.add("long", job)
    worst, ttft = 0.0, None
    while ttft is None or time.perf_counter() - arrived < 2 * ttft:
        events = engine.step()
        now = time.perf_counter()
        for rid, event in events:
            if not isinstance(event, Token):
                continue
            if rid == "long":
                ttft = ttft if ttft is not None else now - arrived
            elif rid in last:
                worst, last[rid] = max(worst, now - last[rid]), now
    return worst, ttft, tokens


def main() -> None:
    torch.set_num_threads(1)
    checkpoint = sys.argv[1] if len(sys.argv) > 1 else "models/tiny-qwen3-omni"
    thinker = Thinker(checkpoint)
    print(f"{checkpoint}: thinker alone, one thread, exact batching off, {REPEATS} repeats alternating (medians)")

    runs = {1: [], 0: []}
    for repeat in range(REPEATS):
        for prefills in runs:
            runs[prefills].append(burst(thinker, prefills, repeat))
    for prefills, label in ((1, "one prompt a step"), (0, "packed (default)")):
        steps = statistics.median(s for s, _ in runs[prefills])
        seconds = statistics.median(t for _, t in runs[prefills])
        print(f"burst of {BURST}, {label:18s}: {steps:3.0f} steps, last first token after {seconds * 1000:7.1f} ms")

    text = " ".join(f"word{i}" for i in range(565))  # about 3,000 tokens
    budgets = {0: [], 2048: [], 512: []}
    for _ in range(REPEATS):
        for budget in budgets:
            budgets[budget].append(long_prompt(thinker, budget, text))
    for budget, results in budgets.items():
        worst = statistics.median(r[0] for r in results)
        ttft = statistics.median(r[1] for r in results)
        label = "none (whole)" if budget == 0 else f"{budget} tokens"
        print(f"{results[0][2]}-token prompt, budget {label:13s}: running streams' longest gap {worst * 1000:7.1f} ms,"
              f" its TTFT {ttft * 1000:7.1f} ms")


if __name__ == "__main__":
    main()
