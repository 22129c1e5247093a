"""The command line and the run plan: systems interleaved, same prompts within a round."""

from __future__ import annotations

import pytest

from bench.config import build_parser, config_from_args
from bench.harness import plan_run_blocks
from bench.systems import System
from services.base.errors import UserError


def config(*extra: str):
    return config_from_args(build_parser().parse_args(["--checkpoint", "ckpt", *extra]))


def test_defaults_cover_concurrency_1_4_16_with_every_system():
    cfg = config()
    assert cfg.concurrency == (1, 4, 16)
    assert cfg.systems == (System.REFERENCE, System.REFERENCE_BATCHED, System.PIPELINE, System.PIPELINE_UNBATCHED)
    assert cfg.threads >= 1


def test_device_flags_pass_through_to_every_stage():
    cfg = config("--device", "cuda", "--dtype", "bfloat16")
    assert cfg.stage_args() == ("--device", "cuda", "--dtype", "bfloat16", "--startup-checks", "before-serving")


def test_within_a_round_every_system_serves_the_same_prompts_and_the_order_flips_between_rounds():
    cfg = config("--concurrency", "4,1", "--requests", "3", "--rounds", "2", "--skip", "pipeline-unbatched")
    blocks = plan_run_blocks(cfg, n_prompts=5)
    level1 = [b for b in blocks if b.concurrency == 1]
    assert [b.system for b in level1] == [System.REFERENCE, System.PIPELINE, System.PIPELINE, System.REFERENCE]
    assert level1[0].prompt_indices == level1[1].prompt_indices == (0, 1, 2)
    assert level1[2].prompt_indices == level1[3].prompt_indices == (3, 4, 0)  # moves on, wraps
    level4 = [b for b in blocks if b.concurrency == 4]
    assert all(len(b.prompt_indices) == 4 for b in level4)  # at least one request per client
    assert [b.system for b in level4[:3]] == [System.REFERENCE, System.REFERENCE_BATCHED, System.PIPELINE]
    assert blocks[0].concurrency == 1  # levels run in increasing order


def test_no_batched_block_at_concurrency_one():
    blocks = plan_run_blocks(config("--concurrency", "1"), n_prompts=8)
    assert System.REFERENCE_BATCHED not in {b.system for b in blocks}


@pytest.mark.parametrize("flags, message", [
    (("--concurrency", "1,x"), "comma-separated integers"),
    (("--concurrency", "0"), ">= 1"),
    (("--skip", "turbo"), "unknown systems"),
    (("--skip", "reference,reference-batched,pipeline,pipeline-unbatched"), "nothing left"),
    (("--rounds", "0"), "--rounds must be >= 1"),
])
def test_bad_flags_are_user_errors(flags, message):
    with pytest.raises(UserError, match=message):
        config(*flags)


def test_presets_set_the_work_per_request_unless_flags_do():
    from bench import config as bench_config
    from bench.presets import PRESETS

    tiny = config()
    assert (tiny.preset, tiny.max_new_tokens, tiny.talker_max_new_tokens, tiny.requests, tiny.rounds) == (
        "tiny", bench_config.DEFAULT_MAX_NEW_TOKENS, bench_config.DEFAULT_TALKER_MAX_NEW_TOKENS,
        bench_config.DEFAULT_REQUESTS, bench_config.DEFAULT_ROUNDS)
    wide = PRESETS["wide"]
    cfg = config("--preset", "wide")
    assert (cfg.preset, cfg.max_new_tokens, cfg.talker_max_new_tokens, cfg.requests, cfg.rounds) == (
        "wide", wide.max_new_tokens, wide.talker_max_new_tokens, wide.requests, wide.rounds)
    assert config("--preset", "wide", "--max-new-tokens", "8").max_new_tokens == 8
    with pytest.raises(UserError, match="--checkpoint is required"):
        config_from_args(build_parser().parse_args([]))


def test_the_wide_layout_is_consistent_and_wide(tmp_path):
    # Its config builds and passes the layout checks, on the meta device (no weights): tens of
    # millions of parameters, most of them in matrices of width 512.
    import torch

    from bench.presets import WIDE_LAYOUT
    from services.runtime.model.checkpoint import Stage, _stage_classes
    from services.tools.tiny_checkpoint import build_config, build_tokenizer

    config = build_config(build_tokenizer(tmp_path), WIDE_LAYOUT)
    counts = {}
    for stage in (Stage.THINKER, Stage.TALKER):
        cls, sub = _stage_classes()[stage]
        with torch.device("meta"):
            counts[stage] = sum(p.numel() for p in cls._from_config(getattr(config, sub)).parameters())
    assert 20e6 < counts[Stage.THINKER] < 60e6 and 20e6 < counts[Stage.TALKER] < 60e6
    assert config.talker_config.code_predictor_config.hidden_size == config.talker_config.text_config.hidden_size


def test_a_qwen2_5_checkpoint_gets_the_same_seconds_of_audio_in_its_own_codes(tiny_qwen2_5_checkpoint, tiny_checkpoint):
    from bench.config import QWEN2_5_CODES_PER_QWEN3_FRAME
    from bench.presets import PRESETS

    def talker_tokens(checkpoint, *extra):
        return config_from_args(build_parser().parse_args(["--checkpoint", str(checkpoint), *extra])).talker_max_new_tokens

    frames = PRESETS["tiny"].talker_max_new_tokens
    assert talker_tokens(tiny_checkpoint) == frames  # Qwen3-Omni: codec frames
    assert talker_tokens(tiny_qwen2_5_checkpoint) == frames * QWEN2_5_CODES_PER_QWEN3_FRAME == 256
    assert talker_tokens(tiny_qwen2_5_checkpoint, "--talker-max-new-tokens", "80") == 80  # given: kept
