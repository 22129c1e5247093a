"""The tiny Qwen2.5-Omni checkpoint: deterministic, small, loadable by transformers offline (voices
included), greedy `generate` runs to both limits with audible audio, and the --eos variant ends.

NOTE: `Qwen2_5OmniProcessor.from_pretrained` needs a Qwen2VLVideoProcessor, which requires
torchvision; no torchvision build matches the CPU torch wheel here, so the processor is checked the
way the oracle builds it (services/tools/reference.py, a stand-in video processor), and the
from_pretrained outcome is checked as whichever torchvision decides.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from services.tools.tiny_checkpoint import main
from services.tools.tiny_qwen2_5_omni import CODEBOOK_SIZE, SPECIAL_TOKENS, VOICES, build

MAX_FOLDER_BYTES = 8_000_000
THINKER_TOKENS = 8
TALKER_TOKENS = 24
SAMPLES_PER_CODE = 2 * 240  # 2 mel frames per code (DiT repeats), 240 samples per mel frame (BigVGAN 5*3*2*2*2*2)
PROMPTS = ("Hello! How are you today?", "What is the weather like?", "Hi", "Sing a song.")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def folder_files(folder: Path) -> dict[str, bytes]:
    # file name -> its bytes
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def rms(audio: torch.Tensor) -> float:
    return audio.double().pow(2).mean().sqrt().item()


@pytest.fixture(scope="module")
def model(tiny_qwen2_5_checkpoint):
    import transformers
    from transformers import Qwen2_5OmniForConditionalGeneration

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_qwen2_5_checkpoint, local_files_only=True).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_5_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2_5_checkpoint, local_files_only=True)


def chat_ids(tokenizer, text: str) -> dict:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True, return_tensors="pt")


def greedy(model, inputs: dict, speaker: str = "Ethan", thinker_tokens: int = THINKER_TOKENS,
           talker_tokens: int = TALKER_TOKENS, **kwargs):
    """generate, greedy, seeded: (new thinker ids, the codes Token2Wav got, the waveform)."""
    codes = []  # [1, n] per Token2Wav call
    hook = model.token2wav.register_forward_pre_hook(lambda mod, args, kw: codes.append(args[0].clone()),
                                                     with_kwargs=True)
    torch.manual_seed(0)
    try:
        sequences, wav = model.generate(**inputs, speaker=speaker, thinker_max_new_tokens=thinker_tokens,
                                        thinker_do_sample=False, talker_max_new_tokens=talker_tokens,
                                        talker_do_sample=False, **kwargs)
    finally:
        hook.remove()
    return sequences[0, inputs["input_ids"].shape[1]:].tolist(), codes[0][0].tolist(), wav


@pytest.mark.exactness
def test_same_seed_builds_byte_identical_folder(tiny_qwen2_5_checkpoint, tmp_path):
    first, second = folder_files(tiny_qwen2_5_checkpoint), folder_files(build(tmp_path / "again", seed=0))
    assert sorted(first) == sorted(second)
    assert {"config.json", "model.safetensors", "spk_dict.pt", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json", "chat_template.jinja"} <= set(first)
    for name in first:
        assert first[name] == second[name], f"{name} differs between two seed-0 builds"


def test_cli_with_another_seed_changes_weights_and_voices_only(tiny_qwen2_5_checkpoint, tmp_path, capsys):
    other = tmp_path / "seed1"
    assert main(["--family", "qwen2_5_omni", "--out", str(other), "--seed", "1"]) == 0
    assert "wrote tiny Qwen2.5-Omni checkpoint" in capsys.readouterr().out
    first, second = folder_files(tiny_qwen2_5_checkpoint), folder_files(other)
    assert {name for name in first if first[name] != second[name]} == {"model.safetensors", "spk_dict.pt"}


def test_folder_is_a_few_megabytes(tiny_qwen2_5_checkpoint):
    size = sum(p.stat().st_size for p in tiny_qwen2_5_checkpoint.iterdir())
    assert 1_000_000 < size < MAX_FOLDER_BYTES, size


def test_safetensors_keys_are_the_three_stage_prefixes_as_save_pretrained_writes_them(tiny_qwen2_5_checkpoint, model):
    from safetensors import safe_open

    with safe_open(str(tiny_qwen2_5_checkpoint / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {k.split(".", 1)[0] for k in keys} == {"thinker", "talker", "token2wav"}
    assert keys == set(model.state_dict())


def test_config_keeps_the_real_codec_ids_and_vocoder_structure(model, tokenizer):
    config = model.config
    talker, dit = config.talker_config, config.token2wav_config.dit_config
    vgan = config.token2wav_config.bigvgan_config
    assert config.model_type == "qwen2_5_omni" and config.enable_audio_output
    # The real codec vocabulary: generate's default talker EOS ids [8292, 8294] are its pad and end.
    assert talker.vocab_size == 8448
    assert (talker.tts_codec_pad_token_id, talker.tts_codec_start_token_id, talker.tts_codec_end_token_id,
            talker.tts_codec_mask_token_id) == (8292, 8293, 8294, 8296)
    assert dit.num_embeds == CODEBOOK_SIZE + 1 and dit.mel_dim == vgan.mel_dim == 80
    assert (dit.block_size, list(dit.look_ahead_layers), list(dit.look_backward_layers), dit.repeats) == (24, [2], [0, 3], 2)
    assert list(vgan.upsample_rates) == [5, 3, 2, 2, 2, 2]
    assert talker.embedding_size == config.thinker_config.text_config.hidden_size
    assert config.thinker_config.text_config.vocab_size == len(tokenizer)  # every id the thinker emits decodes
    assert model.thinker.lm_head.weight.data_ptr() != model.thinker.model.embed_tokens.weight.data_ptr()


def test_config_token_ids_match_the_tokenizer(model, tokenizer):
    ids = tokenizer.convert_tokens_to_ids
    thinker, talker = model.config.thinker_config, model.config.talker_config
    assert (thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id) == (
        ids("<|AUDIO|>"), ids("<|IMAGE|>"), ids("<|VIDEO|>"))
    assert (thinker.audio_start_token_id, thinker.audio_end_token_id) == (ids("<|audio_bos|>"), ids("<|audio_eos|>"))
    assert thinker.vision_start_token_id == talker.vision_start_token_id == ids("<|vision_bos|>")
    assert thinker.eos_token_id == ids("<|im_end|>")
    assert thinker.user_token_id == tokenizer.encode("user", add_special_tokens=False)[0]
    # The talker's text specials are thinker-vocabulary ids (embedded with the thinker's table).
    assert (talker.tts_text_start_token_id, talker.tts_text_end_token_id, talker.tts_text_pad_token_id) == (
        ids("<|tts_text_bos|>"), ids("<|tts_text_eos|>"), ids("<|tts_text_pad|>"))


def test_from_pretrained_loads_the_two_voices_with_the_shapes_token2wav_takes(model, tokenizer):
    dit = model.config.token2wav_config.dit_config
    assert sorted(model.speaker_map) == ["Chelsie", "Ethan"]
    for name, voice in model.speaker_map.items():
        assert voice["bos_token"] == tokenizer.convert_tokens_to_ids(VOICES[name])
        assert voice["cond"].shape == (1, dit.enc_emb_dim)
        assert voice["ref_mel"].shape[0] == 1 and voice["ref_mel"].shape[2] == dit.mel_dim
    assert model.token2wav.dtype == torch.float32


def test_tokenizer_loads_offline_with_single_token_roles_and_specials(tokenizer):
    for word in ("system", "user", "assistant", "\n"):
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1, word
    for special in SPECIAL_TOKENS:
        assert tokenizer.encode(special, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(special)], special
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    # The attribute names Qwen2_5OmniProcessor reads.
    assert (tokenizer.audio_token, tokenizer.image_token, tokenizer.video_token) == ("<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>")
    assert (tokenizer.audio_bos_token, tokenizer.vision_eos_token) == ("<|audio_bos|>", "<|vision_eos|>")


def test_processor_expands_audio_and_image_placeholders_offline(tiny_qwen2_5_checkpoint, wav_bytes, png_bytes):
    import soundfile as sf
    from PIL import Image

    from services.tools.reference import NoVideo, oracle_processor

    processor = oracle_processor(tiny_qwen2_5_checkpoint)
    assert type(processor).__mro__[1].__name__ == "Qwen2_5OmniProcessor"
    assert isinstance(processor.video_processor, NoVideo)
    samples, _ = sf.read(io.BytesIO(wav_bytes), dtype="float32")
    conversation = [{"role": "user", "content": [
        {"type": "audio", "audio": samples}, {"type": "image", "image": Image.open(io.BytesIO(png_bytes))},
        {"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|><|vision_bos|><|IMAGE|><|vision_eos|>hi"
                    "<|im_end|>\n<|im_start|>assistant\n")
    out = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    # 1 s of audio: 100 mel frames -> (100 - 1) // 2 + 1 = 50 -> (50 - 2) // 2 + 1 = 25 placeholders.
    assert ids.count(processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")) == 25
    # 48x64 pixels resize to 56x56: 4x4 patches of 14, merged 2x2 -> 4 placeholders.
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert ids.count(processor.tokenizer.convert_tokens_to_ids("<|IMAGE|>")) == 4


def test_processor_from_pretrained_needs_torchvision_and_nothing_else(tiny_qwen2_5_checkpoint):
    """One outcome, decided by whether torchvision imports here: from_pretrained fails naming
    torchvision, or loads offline."""
    import importlib.util

    from transformers import Qwen2_5OmniProcessor

    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(ImportError, match="(?i)torchvision"):
            Qwen2_5OmniProcessor.from_pretrained(tiny_qwen2_5_checkpoint, local_files_only=True)
    else:
        processor = Qwen2_5OmniProcessor.from_pretrained(tiny_qwen2_5_checkpoint, local_files_only=True)
        assert processor.audio_token == "<|AUDIO|>"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_greedy_generate_runs_to_both_limits_with_audible_audio(model, tokenizer):
    for prompt in PROMPTS[:2]:
        ids, codes, wav = greedy(model, chat_ids(tokenizer, prompt))
        assert len(ids) == THINKER_TOKENS and tokenizer.convert_tokens_to_ids("<|im_end|>") not in ids
        # Every code is a speech code: no EOS, pad or other codec special, none past Token2Wav's table.
        assert len(codes) == TALKER_TOKENS and all(0 <= c < CODEBOOK_SIZE for c in codes), codes
        assert len(set(codes)) > 3, codes
        assert wav.shape == (TALKER_TOKENS * SAMPLES_PER_CODE,)
        assert torch.isfinite(wav).all()
        assert rms(wav) > 0.01 and wav.abs().max().item() < 1.0  # audible; the output clamps at 1


@pytest.mark.exactness
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_audio_follows_the_codes_and_the_voice(model):
    token2wav, voices = model.token2wav, model.speaker_map
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, CODEBOOK_SIZE, (2, 12), generator=gen)

    def decode(row: int, voice: str) -> torch.Tensor:
        torch.manual_seed(0)  # the same initial noise for every decode
        with torch.inference_mode():
            return token2wav(codes[row:row + 1], conditioning=voices[voice]["cond"],
                             reference_mel=voices[voice]["ref_mel"]).reshape(-1)

    first = decode(0, "Ethan")
    assert torch.equal(first, decode(0, "Ethan"))
    for other in (decode(1, "Ethan"), decode(0, "Chelsie")):
        assert rms(first - other) > 0.1 * rms(first)


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    import transformers
    from transformers import Qwen2_5OmniForConditionalGeneration

    folder = build(tmp_path_factory.mktemp("eos25") / "tiny25eos", seed=0, eos=True)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)


@pytest.mark.slow  # 5 s: a checkpoint of its own: make test-slow (CI)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_eos_variant_ends_both_lms_before_their_limits(eos_model, tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for prompt in PROMPTS:
        ids, codes, wav = greedy(eos_model, chat_ids(tokenizer, prompt), thinker_tokens=32, talker_tokens=256,
                                 thinker_eos_token_id=end)
        assert 2 <= len(ids) < 32 and ids[-1] == end, (prompt, ids)
        # generate cuts the codes at the codec EOS, exclusive.
        assert 1 <= len(codes) < 256 and all(c < CODEBOOK_SIZE for c in codes), (prompt, codes)
        assert wav.shape == (len(codes) * SAMPLES_PER_CODE,)
