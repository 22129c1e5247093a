"""Figure: docs/performance.md, "Code2wav's block grid and batching" (code2wav engine CPU per frame
and steps at 1, 4 and 16 requests). Rerun: `.venv/bin/python -m bench.probes.code2wav_engine
models/tiny-qwen3-omni` (run it at another commit from that commit's checkout to compare).

The Qwen3-Omni code2wav engine alone, in-process, one torch thread: C requests whose frames come
in the talker's default chunks (4, 8, 16, 25, 10: 63 frames) round by round, stepped until every
request ended. Reports the engine thread's CPU seconds (time.thread_time, so a loaded machine's
waits for a core are not counted), the best of 3, and the steps it took.
"""

from __future__ import annotations

import sys
import time

import torch

from services.code2wav.config import Code2WavConfig
from services.code2wav.engine import CodecChunk, CodecEnd
from services.code2wav.qwen3_adapter import Qwen3Code2WavAdapter
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig

CHUNKS = (4, 8, 16, 25, 10)


def run(engine, requests: int) -> tuple[float, int]:
    """(engine CPU seconds, steps) for `requests` streams of the talker's chunks."""
    frames = {f"r{i}": torch.randint(0, engine.codebook_size, (sum(CHUNKS), engine.num_quantizers),
                                     generator=torch.Generator().manual_seed(i)) for i in range(requests)}
    for request_id in frames:
        engine.add(request_id)
    cpu, steps, start = 0.0, 0, 0
    for size in (*CHUNKS, 0):
        for request_id, codes in frames.items():
            engine.add_input(request_id, CodecChunk(codes[start:start + size]) if size else CodecEnd())
        start += size
        while engine.has_work():
            began = time.thread_time()
            engine.step()
            cpu += time.thread_time() - began
            steps += 1
    assert engine.running == 0
    return cpu, steps


def main() -> None:
    torch.set_num_threads(1)
    loaded = load_stage(sys.argv[1] if len(sys.argv) > 1 else "models/tiny-qwen3-omni", Stage.CODE2WAV)
    config = Code2WavConfig(serving=ServingConfig(), model=ModelConfig(checkpoint="unused"))
    engine = Qwen3Code2WavAdapter(loaded, config).build_engine()
    for requests in (1, 4, 16):
        runs = [run(engine, requests) for _ in range(3)]
        cpu, steps = min(runs)
        print(f"{requests:2d} requests: {cpu * 1000:6.0f} ms engine CPU, {cpu * 1000 / requests / sum(CHUNKS):.2f} ms a "
              f"frame, {steps} steps")


if __name__ == "__main__":
    main()
