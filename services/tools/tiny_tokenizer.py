"""The tokenizer and processor files of the tiny checkpoints, shared by both families.

A byte-level BPE is trained on a small fixed corpus (deterministic: same inputs, same bytes), with
the family's special tokens added whole, and saved with a tokenizer_config.json and the chat
template in the folder, so `AutoTokenizer.from_pretrained(folder)` and the processors work offline.
"""

from __future__ import annotations

import json
from pathlib import Path

# A small fixed corpus: the BPE merges are learned from it, deterministically.
CORPUS = """
system user assistant system user assistant
You are a helpful voice assistant. Answer briefly and speak clearly.
Hello! How are you today? I am fine, thank you. What is the weather like?
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
Please describe the picture. Please listen to the sound and tell me what you hear.
Streaming speech synthesis turns text into audio one small chunk at a time.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ' " ( ) [ ] { } - _ / \\ @ # $ % & *
Once upon a time there was a small model that learned to talk, sing and tell stories.
The thinker writes the words, the talker turns them into sound codes, the vocoder makes the waves.
"""

ROLES = ("system", "user", "assistant")


def train_tokenizer(out: Path, special_tokens: list[str], chat_template: str,
                    token_attributes: dict[str, str]) -> dict[str, int]:
    """Train the BPE, save tokenizer.json, tokenizer_config.json and chat_template.jinja in `out`;
    return the ids of the special tokens, of the role words and `vocab_size`.
    `token_attributes`: tokenizer attribute name -> special token (e.g. audio_token), the names the
    family's processor reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special_tokens,
        show_progress=False,
    )
    # The role names repeat so that each becomes one token, as in Qwen's vocabulary.
    lines = [line for line in CORPUS.strip().splitlines() if line.strip()] * 8 + list(ROLES) * 64
    tok.train_from_iterator(lines, trainer=trainer)
    ids = {t: tok.token_to_id(t) for t in special_tokens}
    for word in ROLES:
        enc = tok.encode(word).ids
        if len(enc) != 1:
            raise RuntimeError(f"tokenizer: {word!r} must be one token, got {enc}")
        ids[word] = enc[0]
    nl = tok.encode("\n").ids
    assert len(nl) == 1, nl
    tok.save(str(out / "tokenizer.json"))
    ids["vocab_size"] = tok.get_vocab_size()
    _write_tokenizer_config(out, ids, special_tokens, chat_template, token_attributes)
    return ids


def _write_tokenizer_config(out: Path, ids: dict[str, int], special_tokens: list[str], chat_template: str,
                            token_attributes: dict[str, str]) -> None:
    """tokenizer_config.json (Qwen2Tokenizer, the special tokens, the template) and chat_template.jinja."""
    added = {
        str(ids[t]): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in special_tokens
    }
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": added,
        "chat_template": chat_template,
        "extra_special_tokens": dict(token_attributes),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    # The processor's copy, where transformers' processors read it (ProcessorMixin.from_pretrained
    # takes no template from the tokenizer).
    (out / "chat_template.jinja").write_text(chat_template)


def write_preprocessor_config(out: Path, patch_size: int, image_mean: list[float], image_std: list[float]) -> None:
    """Feature extractor (Whisper, 128 mel bins, 30 s) and image processor (Qwen2-VL) in one
    preprocessor_config.json. Images are resized to between 2x2 and 4x4 patches (at most 16 patches,
    4 tokens after the 2x2 merge), so tests stay small."""
    preprocessor = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": 30,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "dither": 0.0,
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": image_mean,
        "image_std": image_std,
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": (2 * patch_size) ** 2,
        "max_pixels": (4 * patch_size) ** 2,
        "size": {"shortest_edge": (2 * patch_size) ** 2, "longest_edge": (4 * patch_size) ** 2},
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2, sort_keys=True) + "\n")


def write_video_preprocessor_config(out: Path, patch_size: int, image_mean: list[float], image_std: list[float]) -> None:
    """The video processor (Qwen2-VL's) in video_preprocessor_config.json. Its frame sizes are
    moot: the omni processors pass their own `size` (at least 128 tokens a frame pair)."""
    video = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "rescale_factor": 1 / 255, "image_mean": image_mean, "image_std": image_std,
        "patch_size": patch_size, "temporal_patch_size": 2, "merge_size": 2, "min_frames": 4, "max_frames": 768,
        "size": {"shortest_edge": (2 * patch_size) ** 2, "longest_edge": (4 * patch_size) ** 2},
    }
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2, sort_keys=True) + "\n")
