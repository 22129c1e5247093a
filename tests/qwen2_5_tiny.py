"""A tiny, seeded Qwen2.5-Omni checkpoint folder for the engine tests (a stand-in until
`omni-tiny-checkpoint --family qwen2_5_omni` exists).

The folder has the Hugging Face layout of Qwen/Qwen2.5-Omni-7B: config.json (model_type
`qwen2_5_omni`), model.safetensors (`thinker.*`, `talker.*`, `token2wav.*`), spk_dict.pt (voice ->
bos_token, cond, ref_mel), a byte-level BPE tokenizer with Qwen2.5-Omni's special tokens
(<|AUDIO|>, <|IMAGE|>, <|audio_bos|>, ...), a chat template of Qwen2.5-Omni's shape (a default
system turn) and Whisper / Qwen2-VL processor files. `layout` varies depth and widths.

The talker's codec vocabulary is small (320: codes, then the specials at 300..304), so the
codec EOS ids are passed explicitly wherever generate's defaults (8292, 8294) would apply. Both
EOS rows of the codec head are zeroed, so greedy decoding runs to the talker's max tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<|IMAGE|>", "<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>",
    "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>",
    "<|voice_chelsie|>", "<|voice_ethan|>",
]
VOICES = {"Chelsie": "<|voice_chelsie|>", "Ethan": "<|voice_ethan|>"}

# The talker's codec vocabulary: codes, then specials placed as in the real one (pad, bos, eos, mask).
CODEC_VOCAB = 320
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 300, 301, 302, 304
TALKER_EOS_IDS = (CODEC_PAD, CODEC_EOS)  # generate's default eos pair is (pad, end) of the real vocabulary

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] + '<|im_end|>\\n' }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<|vision_bos|><|IMAGE|><|vision_eos|>' }}"
    "{% elif content['type'] == 'audio' %}{{ '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """
system user assistant system user assistant
You are a helpful assistant. Answer briefly and speak clearly.
Hello! How are you today? I am fine, thank you. What is the weather like?
The quick brown fox jumps over the lazy dog. Please describe the picture. What do you hear?
Once upon a time there was a small model that learned to talk, sing and tell stories.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100. Punctuation: , . ; : ! ? ' " ( ) - _ /
"""

# Sizes; `layout` entries override them (nested like config.json).
TINY = {
    "text_hidden": 32, "text_layers": 2, "text_heads": 2, "text_kv_heads": 1, "text_intermediate": 64,
    "talker_hidden": 32, "talker_layers": 2, "talker_heads": 2, "talker_kv_heads": 1, "talker_intermediate": 64,
    "talker_head_dim": 16, "mrope_section": [2, 3, 3],
}


# The other configuration the exactness tests run on: deeper, wider, more heads, GQA in the talker.
WIDE = {
    "text_hidden": 48, "text_layers": 3, "text_heads": 3, "text_kv_heads": 1, "text_intermediate": 96,
    "talker_hidden": 64, "talker_layers": 3, "talker_heads": 4, "talker_kv_heads": 2, "talker_intermediate": 128,
}


def build_tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, min_frequency=1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIAL_TOKENS, show_progress=False)
    lines = [line for line in CORPUS.strip().splitlines() if line.strip()] * 8 + ["system", "user", "assistant"] * 64
    tok.train_from_iterator(lines, trainer=trainer)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    for word in ("system", "user", "assistant"):
        enc = tok.encode(word).ids
        assert len(enc) == 1, (word, enc)
        ids[word] = enc[0]
    tok.save(str(out / "tokenizer.json"))
    ids["vocab_size"] = tok.get_vocab_size()
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 4096, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "clean_up_tokenization_spaces": False, "split_special_tokens": False, "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        # The attribute names Qwen2.5-Omni's processor reads from its tokenizer.
        "extra_special_tokens": {
            "audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
            "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>",
            "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return ids


def write_processor_files(out: Path) -> None:
    preprocessor = {
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": 16000,
        "hop_length": 160, "chunk_length": 30, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000,
        "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True, "dither": 0.0,
        "image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
        "do_normalize": True, "do_convert_rgb": True, "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "min_pixels": 32 * 32, "max_pixels": 64 * 64, "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64},
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2, sort_keys=True) + "\n")


def build_config(ids: dict[str, int], layout: dict | None = None):
    from transformers import Qwen2_5OmniConfig

    s = {**TINY, **(layout or {})}
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": s["mrope_section"]}
    text = dict(vocab_size=ids["vocab_size"], hidden_size=s["text_hidden"], intermediate_size=s["text_intermediate"],
                num_hidden_layers=s["text_layers"], num_attention_heads=s["text_heads"],
                num_key_value_heads=s["text_kv_heads"], max_position_embeddings=4096, rope_parameters=mrope,
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False)
    audio = dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=s["text_hidden"], n_window=100, max_source_positions=1500)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=64, out_hidden_size=s["text_hidden"],
                  fullatt_block_indexes=[0])
    mm = dict(audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"],
              video_token_index=ids["<|VIDEO|>"], audio_start_token_id=ids["<|audio_bos|>"],
              audio_end_token_id=ids["<|audio_eos|>"], position_id_per_seconds=25, seconds_per_chunk=2)
    # The real config.json carries the vision ids in the thinker's config too (its rope index reads them).
    thinker = dict(text_config=text, audio_config=audio, vision_config=vision, user_token_id=ids["user"],
                   vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"], **mm)
    talker = dict(
        vocab_size=CODEC_VOCAB, embedding_size=s["text_hidden"], hidden_size=s["talker_hidden"],
        intermediate_size=s["talker_intermediate"], num_hidden_layers=s["talker_layers"],
        num_attention_heads=s["talker_heads"], num_key_value_heads=s["talker_kv_heads"],
        head_dim=s["talker_head_dim"], max_position_embeddings=4096, rope_parameters=mrope,
        tts_text_start_token_id=ids["<|tts_bos|>"], tts_text_end_token_id=ids["<|tts_eos|>"],
        tts_text_pad_token_id=ids["<|tts_pad|>"], tts_codec_start_token_id=CODEC_BOS,
        tts_codec_end_token_id=CODEC_EOS, tts_codec_pad_token_id=CODEC_PAD, tts_codec_mask_token_id=CODEC_MASK,
        vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"],
        spatial_merge_size=2, **mm,
    )
    dit = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, ff_mult=2, emb_dim=16,
               block_size=24, look_ahead_layers=[1], look_backward_layers=[0], repeats=2, num_embeds=CODEC_VOCAB,
               mel_dim=80, enc_emb_dim=16, enc_dim=16, enc_channels=[32, 32, 32, 32, 96],
               enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8,
               enc_res2net_scale=2, enc_se_channels=8)
    bigvgan = dict(mel_dim=80, upsample_initial_channel=128, resblock_kernel_sizes=[3],
                   resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
                   upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                             token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan), enable_audio_output=True)


def build(out: Path, seed: int = 0, layout: dict | None = None) -> Path:
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out)
    write_processor_files(out)
    config = build_config(ids, layout)
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim > 1 and not name.startswith("token2wav."):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)  # larger than default: greedy does not collapse
        for eos in TALKER_EOS_IDS:  # the talker runs to its max tokens
            model.talker.codec_head.weight[eos].zero_()
    model.save_pretrained(out, safe_serialization=True)
    for stale in out.glob("generation_config.json"):
        stale.unlink()
    enc = config.token2wav_config.dit_config.enc_emb_dim
    speakers = {name: {"bos_token": ids[token], "cond": torch.randn(1, enc, generator=gen),
                       "ref_mel": torch.randn(1, 60, 80, generator=gen)} for name, token in VOICES.items()}
    torch.save(speakers, out / "spk_dict.pt")
    return out
