"""Figure: docs/performance.md, "Start-up checks" (what exact mode's checks cost at the real widths).
Rerun: `.venv/bin/python -m bench.probes.startup_checks [--threads 2] [--skip-code2wav]` (several
minutes on 2 cores: the code2wav checks decode about 1,900 frames through the real vocoder).

Every real width of Qwen3-Omni-30B-A3B: the whole real code2wav (8 layers, hidden 1024, decoder
1536, 1920 samples a frame), the thinker and talker cut to 2 layers and 16 / 8 experts, random
weights (services/runtime/model/full_size.py), float32 on the CPU. Each check runs alone, in the
foreground, timed: code2wav's open-block check and batch check (services/code2wav/plan.py, on the
default grid, --max-batch 16 within --max-batch-frames 64), then each LM engine built with its
check before serving (`--exact-batching on`, then `gemm` with a prefix cache: the thinker's prefix
hits are checked there).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from services.base.stages import Stage
from services.code2wav.blocks import BlockGrid
from services.code2wav.incremental import IncrementalVocoder
from services.code2wav.plan import batches_keep_their_bits, open_blocks_keep_their_bits
from services.code2wav.vocoder import measure_geometry
from services.runtime.chunking import DEFAULT_CHUNKS
from services.runtime.model.checkpoint import load_stage
from services.runtime.model.full_size import REAL_LAYOUT, build_random_stage, merge_layout
from services.talker.engine import TalkerEngine
from services.talker.engine_base import TalkerEngineConfig
from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig
from services.tools.tiny_checkpoint import build

LM_CUT = {"thinker_config": {"text_config": {"num_hidden_layers": 2, "num_experts": 16}},
          "talker_config": {"accept_hidden_layer": 1, "text_config": {"num_hidden_layers": 2, "num_experts": 8}}}


def code2wav() -> None:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    model = build_random_stage(Qwen3OmniMoeCode2Wav, Qwen3OmniMoeCode2WavConfig(**REAL_LAYOUT["code2wav_config"]),
                               Stage.CODE2WAV, "cpu", torch.float32, seed=0)
    geometry, grid = measure_geometry(model), BlockGrid(DEFAULT_CHUNKS.schedule())
    with torch.inference_mode():
        started = time.perf_counter()
        why = open_blocks_keep_their_bits(IncrementalVocoder(model, geometry, grid))
        print(f"code2wav open blocks: {time.perf_counter() - started:.1f} s ({why or 'kept their bits'})", flush=True)
        started = time.perf_counter()
        batches, rows, why = batches_keep_their_bits(IncrementalVocoder(model, geometry, grid), 16, 64)
        print(f"code2wav batches: {time.perf_counter() - started:.1f} s ({batches}, rows {rows}: {why})", flush=True)


def lms(folder: Path) -> None:
    build(folder, seed=0, layout=merge_layout(REAL_LAYOUT, LM_CUT), weights=False)
    for stage, engine_cls, config_cls in ((Stage.THINKER, ThinkerEngine, ThinkerEngineConfig),
                                          (Stage.TALKER, TalkerEngine, TalkerEngineConfig)):
        loaded = load_stage(folder, stage, random_weights=True)
        for mode in ("on", "gemm"):
            config = config_cls(exact_gemm=mode == "gemm", prefix_cache_mb=64 if mode == "gemm" else 0,
                                max_model_len=1024)
            engine = engine_cls(loaded.model, loaded.config, engine_config=config)
            print(f"{stage} --exact-batching {mode}: {engine.exact_check.seconds:.2f} s "
                  f"({engine.exact_report.line()})", flush=True)
            del engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-code2wav", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s)")
    if not args.skip_code2wav:
        code2wav()
    with tempfile.TemporaryDirectory() as folder:
        lms(Path(folder))


if __name__ == "__main__":
    main()
