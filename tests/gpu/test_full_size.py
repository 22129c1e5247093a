"""Full size without weights: the real layout in config.json, and stages built with --random-weights.

The real layout is checked on the meta device (no memory); --random-weights runs for real on CPU
with a scaled-down layout written through the same code path (`omni-tiny-checkpoint --layout`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.base.errors import UserError
from services.runtime.inputs.prompt import PromptBuilder
from services.runtime.model.checkpoint import (
    Stage,
    _stage_classes,
    load_config,
    load_for_serving,
    load_stage,
)
from services.runtime.model.full_size import REAL_LAYOUT, check_layout
from services.runtime.model.settings import ModelConfig
from services.talker.engine import TalkerEngine
from services.talker.engine_base import TalkerEngineConfig
from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig
from services.tools.reference import messages_from_args
from services.tools.tiny_checkpoint import build_config, build_tokenizer, main
from tests.gpu.harness import run_pipeline

# The full-size code path at small numbers: every size the real layout sets, scaled down, with the
# same relations (talker vocab = codebook + 1024, hidden sizes that must agree, mrope = head_dim / 2).
SMALL_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3], "interleaved": True}
SMALL_LAYOUT = dict(
    thinker_config=dict(
        text_config=dict(vocab_size=1024, hidden_size=48, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=32, rope_parameters=SMALL_MROPE),
        audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                          output_dim=48, downsample_hidden_size=8),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                           num_position_embeddings=256, deepstack_visual_indexes=[0, 1]),
    ),
    talker_config=dict(
        text_config=dict(vocab_size=128 + 1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=8,
                         num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                         rope_parameters=SMALL_MROPE, norm_topk_prob=True),
        code_predictor_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_code_groups=16,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        num_code_groups=16, thinker_hidden_size=48, accept_hidden_layer=2, spatial_merge_size=2,
        position_id_per_seconds=13,
    ),
    code2wav_config=dict(codebook_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, decoder_dim=64, sliding_window=8),
)


@pytest.fixture(scope="module")
def tokenizer_ids(tmp_path_factory) -> dict:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory) -> Path:
    """A no-weights folder of the scaled-down layout, written by the CLI."""
    out = tmp_path_factory.mktemp("small") / "ckpt"
    layout = out.parent / "layout.json"
    layout.write_text(json.dumps(SMALL_LAYOUT))
    assert main(["--layout", str(layout), "--no-weights", "--out", str(out)]) == 0
    return out


def meta_module(config, stage: Stage) -> torch.nn.Module:
    """transformers' own class of the stage, built from `config` on the meta device (no memory)."""
    cls, sub = _stage_classes()[stage]
    sub_config = getattr(config, sub)
    if stage is Stage.TALKER and not hasattr(sub_config, "audio_config"):
        sub_config.audio_config = config.thinker_config.audio_config  # the transformers quirk load_stage works around
    with torch.device("meta"):
        return cls._from_config(sub_config)


def params(module: torch.nn.Module, skip: str | None = None, experts_per_token: int | None = None) -> int:
    """Parameters of `module` (those under the child `skip` left out). With `experts_per_token`, the
    parameters one token uses: of every fused expert tensor ([experts, ...]) only that share."""
    total = 0
    for name, p in module.named_parameters():
        if skip is not None and name.startswith(f"{skip}."):
            continue
        routed = experts_per_token is not None and ".experts." in f".{name}"
        total += p.numel() * experts_per_token // p.shape[0] if routed else p.numel()
    return total


def within_published(count: int, published: float, last_digit: float) -> bool:
    """Whether `count` rounds to a figure published as `published` to the digit `last_digit`."""
    return abs(count - published) <= last_digit / 2


# Published parameter counts (not the project's layout, not derived from it): the Qwen3-Omni
# Technical Report (arXiv 2509.17765, Table 1: the modules of Qwen3-Omni-30B-A3B) and the
# Qwen/Qwen3-30B-A3B model card (the thinker's language model has its architecture: 48 layers,
# 128 experts, 8 active, 32/4 heads): each as published, with the digit it was rounded to.
B, M = 1e9, 1e6
PUBLISHED = {
    "audio encoder (AuT)": (650 * M, 10 * M),
    "vision encoder (SigLIP2-So400m)": (540 * M, 10 * M),
    "thinker language model, total (Qwen3-30B-A3B: 30.5B)": (30.5 * B, 0.1 * B),
    "thinker language model, non-embedding (Qwen3-30B-A3B: 29.9B)": (29.9 * B, 0.1 * B),
    "thinker language model, active per token (A3B)": (3 * B, 1 * B),
    "talker without its MTP (3B-A0.3B)": (3 * B, 1 * B),
    "talker active per token (A0.3B)": (0.3 * B, 0.1 * B),
    "MTP, the code predictor's transformer (80M)": (80 * M, 10 * M),
    "code2wav (200M)": (200 * M, 100 * M),
}


def test_full_size_config_has_the_real_layout_and_the_tiny_tokenizers_special_ids(tokenizer_ids):
    config = build_config(tokenizer_ids, REAL_LAYOUT)
    text, talker, c2w = config.thinker_config.text_config, config.talker_config, config.code2wav_config
    assert (text.vocab_size, text.hidden_size, text.num_hidden_layers, text.num_experts,
            text.num_experts_per_tok) == (152064, 2048, 48, 128, 8)
    assert (talker.text_config.hidden_size, talker.text_config.num_hidden_layers, talker.text_config.vocab_size,
            talker.accept_hidden_layer) == (1024, 20, 3072, 24)
    assert (talker.code_predictor_config.num_hidden_layers, c2w.decoder_dim, c2w.codebook_size) == (5, 1536, 2048)
    # Special ids: the tiny tokenizer's (prompts work); codec ids: the real checkpoint's.
    assert config.thinker_config.audio_token_id == tokenizer_ids["<|audio_pad|>"]
    assert config.im_end_token_id == tokenizer_ids["<|im_end|>"] and config.user_token_id == tokenizer_ids["user"]
    assert (talker.codec_pad_id, talker.codec_bos_id, talker.codec_eos_token_id) == (2148, 2149, 2150)
    assert talker.speaker_id == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}


def test_the_real_layout_has_the_published_parameter_counts_of_qwen3_omni_30b_a3b(tokenizer_ids):
    """The full-size config, built into transformers' own module classes on the meta device,
    counted module by module against the counts Qwen published (PUBLISHED): a size the layout gets
    wrong (an expert count, a hidden or intermediate size, the experts per token) moves one of
    them off the published figure."""
    config = build_config(tokenizer_ids, REAL_LAYOUT)
    thinker, talker = meta_module(config, Stage.THINKER), meta_module(config, Stage.TALKER)
    code2wav = meta_module(config, Stage.CODE2WAV)
    lm = thinker.model
    thinker_k = config.thinker_config.text_config.num_experts_per_tok
    talker_k = config.talker_config.text_config.num_experts_per_tok
    counted = {
        "audio encoder (AuT)": params(thinker.audio_tower),
        "vision encoder (SigLIP2-So400m)": params(thinker.visual),
        "thinker language model, total (Qwen3-30B-A3B: 30.5B)": params(lm) + params(thinker.lm_head),
        "thinker language model, non-embedding (Qwen3-30B-A3B: 29.9B)": params(lm, skip="embed_tokens"),
        "thinker language model, active per token (A3B)":
            params(lm, experts_per_token=thinker_k) + params(thinker.lm_head),
        "talker without its MTP (3B-A0.3B)": params(talker, skip="code_predictor"),
        "talker active per token (A0.3B)": params(talker, skip="code_predictor", experts_per_token=talker_k),
        "MTP, the code predictor's transformer (80M)": params(talker.code_predictor.model.layers),
        "code2wav (200M)": params(code2wav),
    }
    off = {name: (f"{counted[name] / 1e9:.4f} B", f"published {published / 1e9:g} B")
           for name, (published, digit) in PUBLISHED.items() if not within_published(counted[name], published, digit)}
    assert not off, off


# The published Qwen/Qwen3-Omni-30B-A3B-Instruct config.json values of every field that changes
# compute but not the state dict's shapes (routing normalisation, rotary bases and sections,
# positions per second, position limits, norms, activations, audio windows, vision patching,
# vocoder upsampling). The full-size config must carry each one, whether REAL_LAYOUT sets it or
# the tiny config / transformers' default already equals it.
REAL_COMPUTE_FIELDS = {
    "thinker_config.position_id_per_seconds": 13,
    "thinker_config.text_config.norm_topk_prob": True,
    "thinker_config.text_config.max_position_embeddings": 65536,
    "thinker_config.text_config.rope_parameters.rope_theta": 1000000.0,
    "thinker_config.text_config.rope_parameters.mrope_section": [24, 20, 20],
    "thinker_config.text_config.rope_parameters.interleaved": True,
    "thinker_config.text_config.rms_norm_eps": 1e-6,
    "thinker_config.text_config.hidden_act": "silu",
    "thinker_config.text_config.decoder_sparse_step": 1,
    "thinker_config.text_config.attention_bias": False,
    "thinker_config.text_config.sliding_window": None,
    "thinker_config.audio_config.num_mel_bins": 128,
    "thinker_config.audio_config.n_window": 50,
    "thinker_config.audio_config.n_window_infer": 800,
    "thinker_config.audio_config.conv_chunksize": 500,
    "thinker_config.audio_config.max_source_positions": 1500,
    "thinker_config.audio_config.activation_function": "gelu",
    "thinker_config.audio_config.scale_embedding": False,
    "thinker_config.vision_config.patch_size": 16,
    "thinker_config.vision_config.temporal_patch_size": 2,
    "thinker_config.vision_config.spatial_merge_size": 2,
    "thinker_config.vision_config.hidden_act": "gelu_pytorch_tanh",
    "talker_config.position_id_per_seconds": 13,
    "talker_config.text_config.norm_topk_prob": True,
    "talker_config.text_config.num_experts_per_tok": 6,
    "talker_config.text_config.max_position_embeddings": 32768,
    "talker_config.text_config.rope_parameters.rope_theta": 1000000.0,
    "talker_config.text_config.rope_parameters.mrope_section": [24, 20, 20],
    "talker_config.text_config.rms_norm_eps": 1e-6,
    "talker_config.text_config.hidden_act": "silu",
    "talker_config.text_config.sliding_window": None,
    "talker_config.code_predictor_config.rope_parameters.rope_theta": 1000000.0,
    "talker_config.code_predictor_config.rope_parameters.rope_type": "default",
    "talker_config.code_predictor_config.max_position_embeddings": 32768,
    "talker_config.code_predictor_config.rms_norm_eps": 1e-6,
    "talker_config.code_predictor_config.hidden_act": "silu",
    "talker_config.code_predictor_config.sliding_window": None,
    "code2wav_config.rope_parameters.rope_theta": 10000.0,
    "code2wav_config.max_position_embeddings": 8000,
    "code2wav_config.rms_norm_eps": 1e-5,
    "code2wav_config.layer_scale_initial_scale": 0.01,
    "code2wav_config.num_quantizers": 16,
    "code2wav_config.upsample_rates": [8, 5, 4, 3],
    "code2wav_config.upsampling_ratios": [2, 2],
    "code2wav_config.hidden_act": "silu",
}


def config_field(config, dotted: str):
    value = config
    for name in dotted.split("."):
        value = value[name] if isinstance(value, dict) else getattr(value, name)
    return list(value) if isinstance(value, tuple) else value


def test_full_size_config_has_the_real_compute_fields(tokenizer_ids):
    config = build_config(tokenizer_ids, REAL_LAYOUT)
    wrong = {field: config_field(config, field) for field, want in REAL_COMPUTE_FIELDS.items()
             if config_field(config, field) != want}
    assert not wrong, f"full-size fields that differ from the real config: {wrong}"


@pytest.mark.exactness
def test_full_size_routing_and_rotary_behave_as_the_real_model(tokenizer_ids):
    # The fields above as the modules read them: normalised top-k routing in both MoE LMs, and the
    # code predictor's rotary frequencies from base 1e6 (1e4 gives other positions' angles).
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    config = build_config(tokenizer_ids, REAL_LAYOUT)
    predictor = config.talker_config.code_predictor_config
    with torch.device("meta"):
        router = m.Qwen3OmniMoeTalkerTextTopKRouter(config.talker_config.text_config)
    assert router.norm_topk_prob and router.top_k == 6
    inv_freq, _ = m.Qwen3OmniMoeRotaryEmbedding.compute_default_rope_parameters(predictor)
    head_dim = predictor.head_dim
    want = 1.0 / (1000000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    assert torch.equal(inv_freq, want)


def test_inconsistent_layout_is_refused(tokenizer_ids):
    bad = json.loads(json.dumps(SMALL_LAYOUT))
    bad["talker_config"]["thinker_hidden_size"] = 64
    with pytest.raises(ValueError, match="thinker_hidden_size"):
        build_config(tokenizer_ids, bad)
    check_layout(build_config(tokenizer_ids, SMALL_LAYOUT))


def test_full_size_cli_writes_no_weights_and_loading_needs_random_weights(tmp_path):
    assert main(["--full-size", "--out", str(tmp_path / "x")]) != 0  # needs --no-weights
    out = tmp_path / "full"
    assert main(["--full-size", "--no-weights", "--out", str(out)]) == 0
    assert {f.name for f in out.iterdir()} == {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                               "preprocessor_config.json", "video_preprocessor_config.json"}
    assert load_config(out, need_weights=False).thinker_config.text_config.num_hidden_layers == 48
    with pytest.raises(UserError, match="--random-weights"):
        load_stage(out, Stage.CODE2WAV)


@pytest.mark.parametrize("stage", list(Stage), ids=lambda s: s.value)
def test_random_weights_build_every_stage_on_the_device_in_its_dtype(small_folder, stage):
    loaded = load_for_serving(ModelConfig(checkpoint=str(small_folder), dtype="bfloat16", random_weights=True), stage)
    model = loaded.model
    cls, sub = _stage_classes()[stage]
    with torch.device("meta"):
        reference = cls._from_config(getattr(loaded.config, sub))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == \
           {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert not model.training
    params = list(model.parameters())
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params)
    assert all(bool(torch.isfinite(p.float()).all()) for p in params)
    matrices = [p for p in params if p.ndim >= 2]
    assert all(float(p.detach().float().std()) > 0 for p in matrices)  # really drawn, not left empty or zero


@pytest.mark.exactness
def test_random_weights_are_seeded(small_folder):
    a = load_stage(small_folder, Stage.TALKER, random_weights=True, seed=1).model.state_dict()
    b = load_stage(small_folder, Stage.TALKER, random_weights=True, seed=1).model.state_dict()
    c = load_stage(small_folder, Stage.TALKER, random_weights=True, seed=2).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_random_weight_stages_serve_a_prompt_at_the_small_layout(small_folder):
    stages = {s: load_stage(small_folder, s, random_weights=True) for s in (Stage.THINKER, Stage.TALKER, Stage.CODE2WAV)}
    config = stages[Stage.THINKER].config
    cfg = dict(max_batch_size=2, num_slots=2, max_model_len=96, exact_batching=False)
    thinker = ThinkerEngine(stages[Stage.THINKER].model, config, engine_config=ThinkerEngineConfig(**cfg))
    talker = TalkerEngine(stages[Stage.TALKER].model, config, engine_config=TalkerEngineConfig(**cfg))
    requests = {"r": (messages_from_args("Hello!", None, None, None), 4, 9)}
    tokens, frames, done = run_pipeline(thinker, talker, PromptBuilder(small_folder, config), config, requests)
    assert len(tokens["r"]) == 4
    assert len(frames["r"]) == 8  # the codec EOS row is zeroed: every request runs to its max tokens
    codes = torch.stack(frames["r"])
    assert int(codes.min()) >= 0 and int(codes.max()) < 128
    code2wav = stages[Stage.CODE2WAV].model
    with torch.inference_mode():
        wav = code2wav(codes.T.unsqueeze(0))[0, 0].numpy()
    assert np.isfinite(wav).all() and float(np.sqrt(np.mean(wav ** 2))) > 1e-2
