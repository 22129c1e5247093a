"""Figure: docs/performance.md, "Thinker backends (in process)". Rerun: `.venv-vllm/bin/python -m
bench.probes.thinker_backends` (after `make setup-vllm`).

Tokens per second and TTFT, transformers engine against vLLM: both engines run in this process on
the same checkpoint, prompts and greedy settings, in one invocation, alternating per concurrency
level; each is driven the way its service drives it (`add`, then `step` until idle), so the figures
exclude gRPC. Without --checkpoint it builds the tiny checkpoint with the head_dim that vLLM's CPU
attention supports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.metrics import percentile
from services.base.errors import UserError, run_cli
from services.runtime.inputs.prompt import ChatMessage, Part, PromptBuilder, Role
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import Stage, load_stage
from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig, ThinkerJob, Token
from services.tools.tiny_checkpoint import build

PROMPTS = [
    "Hello! How are you today?",
    "Tell me a short story about a robot learning to sing.",
    "What is the weather like on Mars?",
    "Explain streaming speech synthesis in one paragraph.",
]


@dataclass(frozen=True)
class Row:
    backend: str
    concurrency: int
    requests: int
    tokens_per_s: float
    ttft_ms_p50: float
    ttft_ms_p90: float


def run_level(engine, jobs: list[ThinkerJob], concurrency: int, tag: str) -> tuple[float, list[float]]:
    """Closed loop: `concurrency` requests in flight until all jobs ran; (tokens/s, TTFTs in ms)."""
    pending = list(enumerate(jobs))
    sent: dict[str, float] = {}  # request_id -> when it was added
    first: dict[str, float] = {}  # request_id -> when its first token came
    done: set[str] = set()
    tokens = 0
    start = time.perf_counter()
    while pending or engine.has_work():
        while pending and len(sent) - len(done) < concurrency:
            index, job = pending.pop(0)
            request_id = f"{tag}-{index}"
            sent[request_id] = time.perf_counter()
            engine.add(request_id, job)
        for request_id, event in engine.step():
            if isinstance(event, Token):
                tokens += 1
                first.setdefault(request_id, time.perf_counter())
            if getattr(event, "final", False):
                done.add(request_id)
    wall = time.perf_counter() - start
    return tokens / wall, [(first[r] - sent[r]) * 1000 for r in first]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.probes.thinker_backends", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests", type=int, default=32, help="requests per backend and level")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("out/thinker_backends.json"))
    args = parser.parse_args(argv)

    def run() -> None:
        import torch
        import transformers

        from services.thinker import vllm_backend

        ok, detail = vllm_backend.vllm_available()
        if not ok:
            raise UserError(f"vLLM is not importable ({detail}); run `make setup-vllm` and use .venv-vllm/bin/python")
        transformers.logging.set_verbosity_error()
        torch.set_num_threads(1)
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = build(Path(tempfile.mkdtemp()) / "tiny-hd32", 0, layout=vllm_backend.TINY_LAYOUT_FOR_VLLM_CPU)
        levels = [int(x) for x in args.concurrency.split(",")]
        loaded = load_stage(checkpoint, Stage.THINKER)
        prompts = PromptBuilder(checkpoint, loaded.config)
        messages = [[ChatMessage(Role.USER, (Part(text=PROMPTS[i % len(PROMPTS)] + f" ({i})"),))]
                    for i in range(args.requests)]
        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
        engines = {
            "transformers": ThinkerEngine(loaded.model, loaded.config,
                                          engine_config=ThinkerEngineConfig(max_batch_size=max(levels),
                                                                            num_slots=max(levels))),
            "vllm": vllm_backend.VllmThinkerEngine(vllm_backend.VllmThinkerConfig(
                checkpoint=str(checkpoint), max_num_seqs=max(levels), max_model_len=1024,
                kv_cache_bytes=256 << 20)),
        }
        builders = {"transformers": PromptBuilder.build, "vllm": vllm_backend.build_prompt}
        rows = []
        try:
            for level in levels:
                for name, engine in engines.items():
                    jobs = [ThinkerJob(builders[name](prompts, m), sampling, want_talker_inputs=False) for m in messages]
                    run_level(engine, jobs[:level], level, f"warm{level}")
                    rate, ttfts = run_level(engine, jobs, level, f"c{level}")
                    rows.append(Row(name, level, len(jobs), rate, statistics.median(ttfts), percentile(ttfts, 90)))
                    print(f"{name:12} c={level:<3} {rate:8.0f} tok/s  TTFT p50 {rows[-1].ttft_ms_p50:7.1f} ms  "
                          f"p90 {rows[-1].ttft_ms_p90:7.1f} ms", flush=True)
        finally:
            engines["vllm"].close()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"checkpoint": str(checkpoint), "max_new_tokens": args.max_new_tokens,
                                        "rows": [asdict(r) for r in rows]}, indent=2))
        print(f"wrote {args.out}")

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
