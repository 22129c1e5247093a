"""The tiny Qwen2.5-Omni checkpoint (`omni-tiny-checkpoint --family qwen2_5_omni`).

The folder has the Hugging Face layout of Qwen/Qwen2.5-Omni-7B: config.json (model_type
qwen2_5_omni), model.safetensors with `thinker.*`, `talker.*` and `token2wav.*` keys as
`Qwen2_5OmniForConditionalGeneration.save_pretrained` writes them, spk_dict.pt (the voices Chelsie
and Ethan), and tokenizer and processor files, at about 1.2 million parameters: seconds to build,
no network. docs/qwen2_5-omni.md, "The tiny checkpoint", gives the reasons behind each choice.

Sizes are tiny, structure is the real one: the talker keeps the real codec vocabulary (8448 ids,
codes 0-8191, the codec specials 8292-8296), so `generate`'s default talker EOS ids [8292, 8294]
mean what they mean for the real model; Token2Wav keeps the DiT's block size 24, one look-ahead
and two look-back layers, 2 mel frames per code and 80 mel bins, and BigVGAN's upsampling
(5, 3, 2, 2, 2, 2: 240 samples per mel frame at 24 kHz).

NOTE: weights. The LMs get normal(0, 0.2) matrices (as the Qwen3 tiny), so greedy decoding does not
collapse onto one token. Rows of the heads that would end or derail greedy decoding are zeroed, so
they never win against the largest of hundreds of random logits: the thinker's <|im_end|> and
<|endoftext|>, and every talker id outside the codebook (the codec EOS and pad ids among them; an id
of 8193 or more would also index past Token2Wav's code embedding). So greedy runs always reach
both max-token limits. Token2Wav matrices get a fan-in scaled normal (kaiming-like, gain 1),
SnakeBeta log-scales 0, and BigVGAN's last convolution is scaled so the audio has an rms of about
0.1 (peaks well under the clamp at 1). Same seed, same bytes.
"""

from __future__ import annotations

from pathlib import Path

from services.runtime.model.full_size import merge_layout
from services.runtime.model.full_size_qwen2_5 import check_layout
from services.tools.tiny_tokenizer import train_tokenizer, write_preprocessor_config, write_video_preprocessor_config
from services.tools.tiny_weights import init_weights_, save_config_only, save_model

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    # Stand-in names: the model looks these up by id only (talker_config tts_text_*_token_id and
    # each voice's bos_token), never by text.
    "<|tts_text_pad|>",
    "<|tts_text_bos|>",
    "<|tts_text_eos|>",
    "<|tts_bos_chelsie|>",
    "<|tts_bos_ethan|>",
]

# The attribute names Qwen2_5OmniProcessor reads from its tokenizer.
TOKEN_ATTRIBUTES = {
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "audio_token": "<|AUDIO|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
}

# Voice name (as `generate(speaker=...)` takes it) -> the thinker token its talker prompt starts with.
VOICES = {"Chelsie": "<|tts_bos_chelsie|>", "Ethan": "<|tts_bos_ethan|>"}

# Qwen2.5-Omni's chat turns; audio, image and video parts as the placeholders the processor expands
# (one <|AUDIO|> / <|IMAGE|> / <|VIDEO|> per encoder output position). Renders only the messages
# given (no default system turn).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] == 'audio' -%}{{ '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
    "{%- elif part['type'] == 'image' -%}{{ '<|vision_bos|><|IMAGE|><|vision_eos|>' }}"
    "{%- elif part['type'] == 'video' -%}{{ '<|vision_bos|><|VIDEO|><|vision_eos|>' }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

TEXT_HIDDEN = 32
TALKER_HIDDEN = 32
CODEBOOK_SIZE = 8192  # talker ids [0, 8192) are speech codes; Token2Wav embeds [0, num_embeds]
REF_MEL_FRAMES = 30  # each voice's reference mel, [1, frames, mel_dim]
OUTPUT_RMS = 0.1


def build_tokenizer(out: Path) -> dict[str, int]:
    return train_tokenizer(out, SPECIAL_TOKENS, CHAT_TEMPLATE, TOKEN_ATTRIBUTES)


def write_processor_files(out: Path) -> None:
    """Whisper features as the Qwen3 tiny; Qwen2-VL images with 14-pixel patches and CLIP's mean and std."""
    write_preprocessor_config(out, patch_size=14, image_mean=[0.48145466, 0.4578275, 0.40821073],
                              image_std=[0.26862954, 0.26130258, 0.27577711])
    write_video_preprocessor_config(out, patch_size=14, image_mean=[0.48145466, 0.4578275, 0.40821073],
                                    image_std=[0.26862954, 0.26130258, 0.27577711])


def build_config(ids: dict[str, int], layout: dict | None = None):
    """The tiny config; `layout` (nested dicts of sizes, e.g. full_size_qwen2_5.REAL_LAYOUT) is merged
    over it, while every thinker-vocabulary token id stays the tiny tokenizer's."""
    from transformers import Qwen2_5OmniConfig

    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}
    text_ids = dict(
        audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"],
    )
    thinker = dict(
        text_config=dict(
            vocab_size=ids["vocab_size"], hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32768, rope_parameters=mrope,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
        ),
        audio_config=dict(
            num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
            output_dim=TEXT_HIDDEN, n_window=100, max_source_positions=1500,
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=TEXT_HIDDEN,
            fullatt_block_indexes=[1],
        ),
        **text_ids, vision_token_id=ids["<|vision_pad|>"], user_token_id=ids["user"],
        bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        position_id_per_seconds=25, seconds_per_chunk=2,
    )
    talker = dict(
        vocab_size=8448, embedding_size=TEXT_HIDDEN, hidden_size=TALKER_HIDDEN, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=32768, rope_parameters=mrope, rms_norm_eps=1e-6,
        tts_codec_start_token_id=8293, tts_codec_end_token_id=8294, tts_codec_pad_token_id=8292,
        tts_codec_mask_token_id=8296, tts_text_start_token_id=ids["<|tts_text_bos|>"],
        tts_text_end_token_id=ids["<|tts_text_eos|>"], tts_text_pad_token_id=ids["<|tts_text_pad|>"],
        **text_ids, position_id_per_seconds=25, seconds_per_chunk=2, spatial_merge_size=2,
    )
    dit = dict(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, head_dim=16, ff_mult=2, emb_dim=16,
        max_position_embeddings=32768, block_size=24, look_ahead_layers=[2], look_backward_layers=[0, 3],
        repeats=2, num_embeds=CODEBOOK_SIZE + 1, mel_dim=80, enc_emb_dim=16, enc_dim=16,
        enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
        enc_attention_channels=8, enc_res2net_scale=2, enc_se_channels=8,
    )
    bigvgan = dict(
        mel_dim=80, upsample_initial_channel=64, resblock_kernel_sizes=[3, 7, 11],
        resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
        upsample_kernel_sizes=[11, 7, 4, 4, 4, 4],
    )
    stages = merge_layout(
        dict(thinker_config=thinker, talker_config=talker,
             token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan)),
        layout or {},
    )
    config = Qwen2_5OmniConfig(**stages, enable_audio_output=True)
    check_layout(config)
    return config


def init_weights(model, seed: int) -> None:
    """Seeded init that makes every stage do something visible: tiny_weights.init_weights_, then this
    family's head rows and output level (see the module docstring)."""
    import torch

    init_weights_(model, torch.Generator().manual_seed(seed), "token2wav.")
    with torch.no_grad():
        thinker_cfg = model.config.thinker_config
        for token_id in (thinker_cfg.eos_token_id, thinker_cfg.pad_token_id):
            model.thinker.lm_head.weight[token_id].zero_()
        model.talker.codec_head.weight[CODEBOOK_SIZE:].zero_()


def make_voices(config, ids: dict[str, int], seed: int) -> dict[str, dict]:
    """name -> {bos_token: int, cond: [1, enc_emb_dim], ref_mel: [1, frames, mel_dim]}, as spk_dict.pt holds."""
    import torch

    dit = config.token2wav_config.dit_config
    gen = torch.Generator().manual_seed(seed + 1)
    voices = {}
    for name, token in VOICES.items():
        voices[name] = {
            "bos_token": ids[token],
            "cond": torch.randn(1, dit.enc_emb_dim, generator=gen),
            # Log-mel-like values: around -5 with unit spread.
            "ref_mel": torch.randn(1, REF_MEL_FRAMES, dit.mel_dim, generator=gen) - 5.0,
        }
    return voices


def scale_output(model, voices: dict[str, dict], seed: int) -> None:
    """Scale BigVGAN's last convolution so Token2Wav's audio of random codes has an rms of OUTPUT_RMS."""
    import torch

    gen = torch.Generator().manual_seed(seed + 2)
    token2wav = model.token2wav
    voice = voices["Chelsie"]
    codes = torch.randint(0, CODEBOOK_SIZE, (1, 48), generator=gen)
    captured = []  # conv_post's output, before the clamp to [-1, 1]
    hook = token2wav.code2wav_bigvgan_model.conv_post.register_forward_hook(lambda mod, inp, out: captured.append(out))
    fork = torch.random.fork_rng()
    with fork, torch.no_grad():
        torch.manual_seed(seed)  # the DiT's initial noise
        token2wav(codes, conditioning=voice["cond"], reference_mel=voice["ref_mel"])
        hook.remove()
        rms = captured[0].pow(2).mean().sqrt().item()
        token2wav.code2wav_bigvgan_model.conv_post.weight.mul_(OUTPUT_RMS / max(rms, 1e-6))


# The EOS variant (`build(..., eos=True)`): each end token's head row points along the mean of its LM's
# final hidden states at later decode steps, turned away from the first step's mean so the end token
# never wins there (generate fails on a thinker or talker that ends on its first token), and scaled
# so its logit is this fraction of the typical winning logit. What it gives on the seed-0 checkpoint
# (tests/tools/test_tiny_qwen2_5_omni.py checks some): on eight chat prompts the thinker ends after 2
# to 8 tokens (never on its first) and the talker within a code of the text's end (1 to 9 codes: its
# EOS wins once the thinker's reply has run out); the scales barely matter (0.7 to 0.9 gave the same).
THINKER_EOS_SCALE = 0.9
TALKER_EOS_SCALE = 0.8
FIRST_STEP_AWAY = 0.5  # how far the row turns against the first step's direction, in units of its norm
CALIBRATION_PROMPTS = ("Hello! How are you today?", "Tell me a long story.", "Please describe the picture.")


def point_row(head, row: int, first, later, scale: float, columns: int) -> None:
    """Set head.weight[row] from final hidden states at the first decode step (`first`, [N, width]) and
    at later ones (`later`, [M, width]): along later's mean, against first's, `scale` times the mean
    winning logit among the first `columns` rows at later steps."""
    away = first.mean(0) / first.mean(0).norm()
    direction = later.mean(0)
    direction = direction - (direction @ away) * away - FIRST_STEP_AWAY * direction.norm() * away
    direction = direction / direction.norm()
    winning = (later @ head.weight[:columns].T).max(-1).values.mean()
    head.weight[row] = direction * scale * winning / (later @ direction).mean()


def make_eos_win(model, folder: Path, ids: dict[str, int], voices: dict[str, dict]) -> None:
    """Re-point the talker's codec EOS row and the thinker's <|im_end|> row, measured on greedy runs of
    a few fixed chat prompts (deterministic: same weights, same rows)."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompts = [torch.tensor([tok.encode(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n").ids])
               for p in CALIBRATION_PROMPTS]
    model.speaker_map = voices
    with torch.no_grad():
        # The talker first, on thinkers that run to their limit (an ending thinker would change its input).
        calls = []  # per codec-head call, its input rows: the prefill's, then one per decode step
        hook = model.talker.codec_head.register_forward_hook(lambda mod, inp, out: calls.append(inp[0][0]))
        first, later = [], []
        for p in prompts:
            calls.clear()
            model.generate(input_ids=p, attention_mask=torch.ones_like(p), speaker="Chelsie", thinker_max_new_tokens=8,
                           thinker_do_sample=False, talker_max_new_tokens=16, talker_do_sample=False)
            first.append(calls[0][-1:])
            later.extend(calls[1:])
        hook.remove()
        point_row(model.talker.codec_head, model.config.talker_config.tts_codec_end_token_id, torch.cat(first),
                  torch.cat(later), TALKER_EOS_SCALE, CODEBOOK_SIZE)
        first, later = [], []
        for p in prompts:
            run = model.thinker.generate(input_ids=p, max_new_tokens=12, do_sample=False, output_hidden_states=True,
                                         return_dict_in_generate=True, eos_token_id=None)
            first.append(run.hidden_states[0][-1][0, -1:])
            later.extend(step[-1][0] for step in run.hidden_states[1:])
        point_row(model.thinker.lm_head, ids["<|im_end|>"], torch.cat(first), torch.cat(later), THINKER_EOS_SCALE,
                  ids["vocab_size"])


def build(out: Path, seed: int, layout: dict | None = None, weights: bool = True, eos: bool = False) -> Path:
    """Write the folder (see `services.tools.tiny_checkpoint.build`, whose arguments these are)."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out)
    write_processor_files(out)
    config = build_config(ids, layout)
    voices = make_voices(config, ids, seed)
    if not weights:  # voices are data, not weights: a --random-weights stage still needs them
        save_config_only(out, config)
        torch.save(voices, out / "spk_dict.pt")
        return out
    # One thread while the weights are made: the calibration passes then give the same floats (and
    # bytes) whatever the machine's thread count, and skip the thread start-up that dominates at
    # these sizes (6 s instead of 15 to 50 s on two busy cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = Qwen2_5OmniForConditionalGeneration(config).eval()
        init_weights(model, seed)
        scale_output(model, voices, seed)
        if eos:
            make_eos_win(model, out, ids, voices)
    finally:
        torch.set_num_threads(threads)
    save_model(out, model)
    torch.save(voices, out / "spk_dict.pt")
    return out
