"""Qwen2.5-Omni-7B at its real shape without its weights: the layout, its consistency check, and the
random-weight init of a stage built at that shape (`--random-weights`).

`REAL_LAYOUT` holds Qwen/Qwen2.5-Omni-7B's config.json values in every field that shapes the state
dict or changes compute; `omni-tiny-checkpoint --family qwen2_5_omni --full-size --no-weights`
merges it into the tiny config (special token ids stay the tiny tokenizer's, so prompts work).
10.73 B parameters (the published model card's 10.7 B): thinker 8.93 B (LM 7.62 B, audio encoder
0.64 B, vision encoder 0.68 B), talker 1.35 B, Token2Wav 0.45 B (DiT 0.33 B, BigVGAN 0.12 B).

NOTE: transformers' config defaults are not the 7B's everywhere: the vision encoder's hidden_size
defaults to 3584 (7B: 1280, its out_hidden_size is 3584) and the talker's hidden_size, layers and
heads default to the thinker's (7B: 896, 24 and 12 with 4 KV heads of 128). So every size is written
out here, defaults or not; docs/qwen2_5-omni.md, "Full size", lists the fields and their sources.
"""

from __future__ import annotations

from services.base.stages import Stage
from services.runtime.model.full_size import fill_random_

REAL_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
REAL_LAYOUT = dict(
    thinker_config=dict(
        text_config=dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, rope_parameters=REAL_MROPE, max_position_embeddings=32768,
            rms_norm_eps=1e-6, use_sliding_window=False, tie_word_embeddings=False, hidden_act="silu",
        ),
        audio_config=dict(
            num_mel_bins=128, d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
            output_dim=3584, n_window=100, max_source_positions=1500, activation_function="gelu",
        ),
        vision_config=dict(
            depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=3584,
            fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu",
        ),
        position_id_per_seconds=25, seconds_per_chunk=2,
    ),
    talker_config=dict(
        vocab_size=8448, embedding_size=3584, hidden_size=896, intermediate_size=18944, num_hidden_layers=24,
        num_attention_heads=12, num_key_value_heads=4, head_dim=128, rope_parameters=REAL_MROPE,
        max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False, hidden_act="silu",
        tts_codec_start_token_id=8293, tts_codec_end_token_id=8294, tts_codec_pad_token_id=8292,
        tts_codec_mask_token_id=8296, position_id_per_seconds=25, seconds_per_chunk=2, spatial_merge_size=2,
    ),
    token2wav_config=dict(
        dit_config=dict(
            hidden_size=1024, num_hidden_layers=22, num_attention_heads=16, head_dim=64, ff_mult=2, emb_dim=512,
            max_position_embeddings=32768, block_size=24, look_ahead_layers=[10], look_backward_layers=[0, 20],
            repeats=2, num_embeds=8193, mel_dim=80, enc_emb_dim=192, enc_dim=128,
            enc_channels=[256, 256, 256, 256, 768], enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
            enc_attention_channels=64, enc_res2net_scale=2, enc_se_channels=64,
        ),
        bigvgan_config=dict(
            mel_dim=80, upsample_initial_channel=1536, resblock_kernel_sizes=[3, 7, 11],
            resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
            upsample_kernel_sizes=[11, 7, 4, 4, 4, 4],
        ),
    ),
)

CODEBOOK_SIZE = 8192  # talker ids [0, 8192) are speech codes; the codec specials sit above


def check_layout(config) -> None:
    """Raise ValueError where sizes that must agree do not (a hand-written layout's mistakes)."""
    th, tk, t2w = config.thinker_config, config.talker_config, config.token2wav_config
    dit, vgan = t2w.dit_config, t2w.bigvgan_config
    hidden = th.text_config.hidden_size
    problems = []
    for name, value in (("audio output_dim", th.audio_config.output_dim),
                        ("vision out_hidden_size", th.vision_config.out_hidden_size),
                        ("talker embedding_size", tk.embedding_size)):
        if value != hidden:
            problems.append(f"{name} {value} != thinker hidden {hidden}")
    text_head_dim = hidden // th.text_config.num_attention_heads
    for name, rope, head_dim in ((Stage.THINKER, th.text_config.rope_parameters, text_head_dim),
                                 (Stage.TALKER, tk.rope_parameters, tk.head_dim)):
        section = (rope or {}).get("mrope_section")
        if section and 2 * sum(section) != head_dim:
            problems.append(f"{name} mrope_section {section} does not fill head_dim {head_dim}")
    for name in ("tts_codec_start_token_id", "tts_codec_end_token_id", "tts_codec_pad_token_id",
                 "tts_codec_mask_token_id"):
        if not CODEBOOK_SIZE <= getattr(tk, name) < tk.vocab_size:
            problems.append(f"talker {name} outside [{CODEBOOK_SIZE}, talker vocab)")
    if dit.num_embeds < CODEBOOK_SIZE:
        problems.append(f"DiT num_embeds {dit.num_embeds} < codebook {CODEBOOK_SIZE}")
    if dit.mel_dim != vgan.mel_dim:
        problems.append(f"DiT mel_dim {dit.mel_dim} != BigVGAN mel_dim {vgan.mel_dim}")
    if any(not 0 <= i < dit.num_hidden_layers for i in [*dit.look_ahead_layers, *dit.look_backward_layers]):
        problems.append("DiT look-ahead / look-back layer index outside its layers")
    if vgan.upsample_initial_channel % 2 ** len(vgan.upsample_rates):
        problems.append("BigVGAN upsample_initial_channel must halve once per upsampling layer")
    if problems:
        raise ValueError("inconsistent layout: " + "; ".join(problems))


def init_random_(model, seed: int, stage: Stage | None, device) -> None:
    """Seeded in-place init on the model's device: Qwen3-Omni's `fill_random_` (matrices normal(0,
    1/sqrt(fan_in)), norms 1, biases and SnakeBeta log-scales 0), then the talker's non-code rows zeroed
    (greedy runs to its max tokens, no id past Token2Wav's code embedding) and Token2Wav's output scaled
    to an rms of about 0.1."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    fill_random_(model, gen)
    with torch.no_grad():
        if stage == Stage.TALKER:
            model.codec_head.weight[CODEBOOK_SIZE:].zero_()
        if stage == Stage.CODE2WAV:
            _scale_token2wav_output(model, gen)


def _scale_token2wav_output(model, gen, rms_target: float = 0.1) -> None:
    import torch

    dit = model.config.dit_config
    device = gen.device
    codes = torch.randint(0, CODEBOOK_SIZE, (1, 48), generator=gen, device=device)
    cond = torch.randn(1, dit.enc_emb_dim, generator=gen, device=device)
    ref_mel = torch.randn(1, 30, dit.mel_dim, generator=gen, device=device) - 5.0
    captured = []  # conv_post's output, before the clamp to [-1, 1]
    conv_post = model.code2wav_bigvgan_model.conv_post
    hook = conv_post.register_forward_hook(lambda mod, inp, out: captured.append(out))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode():
        torch.manual_seed(0)
        model(codes, conditioning=cond, reference_mel=ref_mel)
    hook.remove()
    rms = captured[0].float().pow(2).mean().sqrt().item()
    with torch.no_grad():
        conv_post.weight.mul_(rms_target / max(rms, 1e-6))
