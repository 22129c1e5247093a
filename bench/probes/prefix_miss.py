"""Figure: docs/performance.md, "What a prefix-cache miss costs" (the thinker's prefill CPU with the
cache on, every lookup a miss, against the cache off). Rerun: `.venv/bin/python -m
bench.probes.prefix_miss models/wide-qwen3-omni` (`make bench-wide` generates the checkpoint).

The thinker engine alone, in-process, one torch thread, `--exact-batching gemm` (the mode that
uses hits, so a miss stores its blocks). Prompts of several lengths whose text no other prompt
shares, so every lookup misses: what a prefill pays for the cache when nothing repeats (the
block keys' hashing, the lookup, the copy of each whole block's keys and values into the pool).
Each request runs alone to its first token (prefill, max_new_tokens 1), the engines with and
without a cache alternating; reported is the engine thread's CPU (time.thread_time), the median
of the repeats, and the cached engine's lookups (all misses).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from omni.v1 import omni_pb2
from services.base.families import family_of
from services.runtime.inputs.prompt import PromptBuilder
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import Stage, load_stage
from services.thinker.admission import messages_from_proto, prompt_prefix
from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig
from services.thinker.server import ADAPTERS

WORDS = 10, 40, 150, 280  # words of user text: prompts of about 100, 300, 1000 and 1900 tokens
REPEATS = 5


def request(words: int, salt: int) -> omni_pb2.GenerateRequest:
    out = omni_pb2.GenerateRequest()
    out.messages.add(role=omni_pb2.ROLE_SYSTEM).content.add(text=f"Session {salt}: you are a helpful assistant.")
    text = " ".join(f"w{salt}x{i}" for i in range(words))  # shared with no other prompt: every block a miss
    out.messages.add(role=omni_pb2.ROLE_USER).content.add(text=text)
    return out


def prefill_cpu(engine: ThinkerEngine, job, request_id: str) -> float:
    engine.add(request_id, job)
    cpu = 0.0
    while engine.has_work():
        began = time.thread_time()
        engine.step()
        cpu += time.thread_time() - began
    return cpu


def main() -> None:
    torch.set_num_threads(1)
    checkpoint = sys.argv[1] if len(sys.argv) > 1 else "models/wide-qwen3-omni"
    loaded = load_stage(checkpoint, Stage.THINKER)
    builder = PromptBuilder(checkpoint, loaded.config)
    adapter = ADAPTERS[family_of(checkpoint)](checkpoint, loaded.config, builder)
    im_start = builder.tokenizer.convert_tokens_to_ids("<|im_start|>")
    engine_cls = adapter.engine

    def engine(cache_mb: int) -> ThinkerEngine:
        config = ThinkerEngineConfig(max_batch_size=1, num_slots=1, max_model_len=2048, exact_batching=True,
                                     exact_gemm=True, prefix_cache_mb=cache_mb)
        return engine_cls(loaded.model, loaded.config, engine_config=config)

    cached, cold = engine(512), engine(0)
    salt = 0
    for words in WORDS:
        times = {"cache": [], "off": []}
        tokens = 0
        for _ in range(REPEATS):
            for name, eng in (("cache", cached), ("off", cold)):
                salt += 1
                req = request(words, salt)
                prompt = builder.build(messages_from_proto(req))
                tokens = prompt.num_tokens
                made = adapter.job(prompt, SamplingConfig(max_new_tokens=1), False, (), adapter.resolve_voice(None))
                job = dataclasses.replace(made, prefix=prompt_prefix(req, prompt.input_ids[0], im_start))
                times[name].append(prefill_cpu(eng, job, f"r{salt}"))
        with_cache, without = statistics.median(times["cache"]), statistics.median(times["off"])
        print(f"{tokens:4d} tokens: prefill {without * 1000:6.1f} ms without the cache, {with_cache * 1000:6.1f} ms "
              f"with it (every lookup a miss): {(with_cache / without - 1) * 100:+.1f} %")
    stats = cached.prefix_pool.stats
    assert stats.hit_tokens == 0, stats
    print(f"cached engine: {stats.lookup_tokens} tokens looked up, {stats.hit_tokens} found")


if __name__ == "__main__":
    main()
