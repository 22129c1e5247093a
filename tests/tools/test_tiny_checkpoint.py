"""The tiny checkpoint: deterministic, small, loadable by transformers offline, the real layout.

NOTE: `AutoProcessor.from_pretrained` on the folder raises ImportError (transformers 5.19):
Qwen3OmniMoeProcessor wants a Qwen2VLVideoProcessor, which requires torchvision, and no
torchvision build matches the CPU torch wheel here. That is why services/runtime/inputs/prompt.py drives
the tokenizer, feature extractor and image processor itself, and why the oracle
(services/tools/reference.py) builds the processor class with a stand-in video processor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.runtime.model.checkpoint import Stage, load_stage
from services.tools.tiny_checkpoint import SPECIAL_TOKENS, build

MAX_FOLDER_BYTES = 8_000_000


def folder_files(folder: Path) -> dict[str, bytes]:
    # file name -> its bytes
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def config(tiny_checkpoint):
    from transformers import Qwen3OmniMoeConfig

    return Qwen3OmniMoeConfig.from_pretrained(tiny_checkpoint, local_files_only=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint, local_files_only=True)


@pytest.mark.exactness
def test_same_seed_builds_byte_identical_folder(tiny_checkpoint, tmp_path):
    again = build(tmp_path / "again", seed=0)
    first, second = folder_files(tiny_checkpoint), folder_files(again)
    assert sorted(first) == sorted(second)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json"} <= set(first)
    for name in first:
        assert first[name] == second[name], f"{name} differs between two seed-0 builds"


def test_cli_with_another_seed_writes_different_weights(tiny_checkpoint, tmp_path, capsys):
    from services.tools.tiny_checkpoint import main

    other = tmp_path / "seed1"
    assert main(["--out", str(other), "--seed", "1"]) == 0
    assert "wrote tiny Qwen3-Omni checkpoint" in capsys.readouterr().out
    assert (other / "model.safetensors").read_bytes() != (tiny_checkpoint / "model.safetensors").read_bytes()
    # Only the weights depend on the seed.
    assert (other / "config.json").read_bytes() == (tiny_checkpoint / "config.json").read_bytes()


def test_folder_is_a_few_megabytes(tiny_checkpoint):
    size = sum(p.stat().st_size for p in tiny_checkpoint.iterdir())
    assert 100_000 < size < MAX_FOLDER_BYTES, size


def test_cli_refuses_an_out_path_that_is_a_file(tmp_path, capsys):
    from services.tools.tiny_checkpoint import main

    target = tmp_path / "a_file"
    target.write_text("x")
    assert main(["--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(target) in err


def test_tokenizer_loads_offline_with_single_token_roles_and_specials(tokenizer):
    for word in ("system", "user", "assistant", "\n"):
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1, word
    for special in SPECIAL_TOKENS:
        ids = tokenizer.encode(special, add_special_tokens=False)
        assert ids == [tokenizer.convert_tokens_to_ids(special)], special
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    # The attribute names of Qwen3-Omni's own tokenizer_config, which prompt.py reads.
    assert tokenizer.audio_token == "<|audio_pad|>"
    assert tokenizer.image_token == "<|image_pad|>"


def test_chat_template_renders_qwen_turns(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True, tokenize=False,
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>hi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_feature_extractor_and_image_processor_load(tiny_checkpoint):
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    fe = AutoFeatureExtractor.from_pretrained(tiny_checkpoint, local_files_only=True)
    assert type(fe).__name__ == "WhisperFeatureExtractor"
    assert (fe.feature_size, fe.sampling_rate) == (128, 16000)
    ip = AutoImageProcessor.from_pretrained(tiny_checkpoint, local_files_only=True)
    assert type(ip).__name__.startswith("Qwen2VLImageProcessor")
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (16, 2, 2)


def test_auto_processor_needs_torchvision_and_the_oracle_builds_it_without(tiny_checkpoint):
    """One outcome, decided by whether torchvision imports here (it does not beside the CPU torch
    wheel): AutoProcessor fails naming torchvision, or loads; the oracle's processor builds either way."""
    import importlib.util

    from transformers import AutoProcessor

    from services.tools.reference import NoVideo, oracle_processor

    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(ImportError, match="(?i)torchvision"):
            AutoProcessor.from_pretrained(tiny_checkpoint, local_files_only=True)
    else:
        processor = AutoProcessor.from_pretrained(tiny_checkpoint, local_files_only=True)
        assert processor.tokenizer is not None and processor.feature_extractor is not None
    oracle = oracle_processor(tiny_checkpoint)
    assert type(oracle).__mro__[1].__name__ == "Qwen3OmniMoeProcessor"
    assert isinstance(oracle.video_processor, NoVideo)
    assert oracle.chat_template == oracle.tokenizer.chat_template


def test_config_has_the_real_talker_layout(config):
    talker = config.talker_config
    thinker_layers = config.thinker_config.text_config.num_hidden_layers
    codebook = config.code2wav_config.codebook_size
    vocab = talker.text_config.vocab_size

    assert config.model_type == "qwen3_omni_moe"
    assert config.enable_audio_output
    assert talker.num_code_groups == 16
    assert talker.code_predictor_config.num_code_groups == 16
    assert config.code2wav_config.num_quantizers == 16
    assert 0 <= talker.accept_hidden_layer <= thinker_layers
    assert talker.thinker_hidden_size == config.thinker_config.text_config.hidden_size
    assert talker.code_predictor_config.vocab_size == codebook
    # Talker vocabulary: the codebook, then 1024 ids for codec specials and speakers.
    assert vocab == codebook + 1024
    specials = {
        "codec_eos_token_id": talker.codec_eos_token_id,
        "codec_pad_id": talker.codec_pad_id,
        "codec_bos_id": talker.codec_bos_id,
        "codec_nothink_id": talker.codec_nothink_id,
        "codec_think_bos_id": talker.codec_think_bos_id,
        "codec_think_eos_id": talker.codec_think_eos_id,
        **{f"speaker {name}": i for name, i in talker.speaker_id.items()},
    }
    for name, token_id in specials.items():
        assert vocab - 1024 <= token_id < vocab, (name, token_id)
    assert len(set(specials.values())) == len(specials)
    assert sorted(talker.speaker_id) == ["aiden", "chelsie", "ethan"]


def test_config_token_ids_match_the_tokenizer(config, tokenizer):
    ids = tokenizer.convert_tokens_to_ids
    assert config.im_start_token_id == ids("<|im_start|>")
    assert config.im_end_token_id == ids("<|im_end|>")
    assert config.tts_pad_token_id == ids("<tts_pad>")
    assert config.tts_bos_token_id == ids("<tts_text_bos>")
    assert config.tts_eos_token_id == ids("<tts_text_eod>")
    assert config.thinker_config.audio_token_id == ids("<|audio_pad|>")
    assert config.thinker_config.image_token_id == ids("<|image_pad|>")
    assert config.assistant_token_id == tokenizer.encode("assistant", add_special_tokens=False)[0]
    # Every id the thinker can emit decodes.
    assert config.thinker_config.text_config.vocab_size == len(tokenizer)


def test_code2wav_of_random_codes_is_audible_and_not_clipped(tiny_checkpoint, config):
    model = load_stage(tiny_checkpoint, Stage.CODE2WAV).model
    cfg = config.code2wav_config
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, 12), generator=gen)  # [B, Q, frames]
    with torch.inference_mode():
        wav = model(codes).reshape(-1)
    rms = wav.pow(2).mean().sqrt().item()
    peak = wav.abs().max().item()
    assert rms > 0.01, rms
    assert peak < 1.0, peak  # the forward clamps to [-1, 1]; a peak of 1 means clipping
