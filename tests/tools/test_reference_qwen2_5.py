"""ReferenceRunner on the tiny Qwen2.5-Omni checkpoint: transformers' own generate, greedy and seeded.

The tiny checkpoint's talker never picks a codec special, so greedy runs to the limits: 8 text
tokens and 24 codes, one per frame (Qwen2.5-Omni's talker emits one codebook), 480 samples each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.base.errors import InvalidArgument
from services.runtime.inputs.prompt import ChatMessage, Part, Role
from services.runtime.model.checkpoint import Stage, load_stage, load_voices
from services.tools.reference import TOKEN2WAV_SEED, ReferenceRunner

MAX_NEW_TOKENS = 8
TALKER_MAX_NEW_TOKENS = 24
SAMPLES_PER_CODE = 480
PROMPT = "Hello! How are you today?"

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]


def user(*parts: Part) -> list[ChatMessage]:
    return [ChatMessage(Role.USER, tuple(parts))]


def rms(audio: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(audio.astype(np.float64)))))


@pytest.fixture(scope="module")
def runner(tiny_qwen2_5_checkpoint) -> ReferenceRunner:
    return ReferenceRunner(tiny_qwen2_5_checkpoint)


@pytest.fixture(scope="module")
def text_result(runner):
    return runner.generate(user(Part(text=PROMPT)), None, MAX_NEW_TOKENS, TALKER_MAX_NEW_TOKENS)


def test_text_prompt_gives_tokens_one_code_frames_and_audio(runner, text_result):
    assert len(text_result.thinker_token_ids) == MAX_NEW_TOKENS
    assert text_result.text == runner.decode(text_result.thinker_token_ids)
    assert len(text_result.codec_frames) == TALKER_MAX_NEW_TOKENS
    assert all(len(frame) == 1 and 0 <= frame[0] < 8192 for frame in text_result.codec_frames)
    assert text_result.audio.dtype == np.float32
    assert len(text_result.audio) == TALKER_MAX_NEW_TOKENS * SAMPLES_PER_CODE
    assert rms(text_result.audio) > 0.01 and np.abs(text_result.audio).max() < 1.0
    assert text_result.sample_rate == 24000 and text_result.prompt_tokens > 0


@pytest.mark.exactness
def test_audio_is_token2wav_of_the_frames_from_the_seeded_noise(tiny_qwen2_5_checkpoint, text_result):
    """What a code2wav stage must reproduce: Token2Wav of the codes with the voice's cond and ref_mel,
    its initial noise drawn right after torch.manual_seed(TOKEN2WAV_SEED)."""
    token2wav = load_stage(tiny_qwen2_5_checkpoint, Stage.CODE2WAV).model
    voice = load_voices(tiny_qwen2_5_checkpoint)["Chelsie"]  # the default voice, generate's
    codes = torch.tensor([[frame[0] for frame in text_result.codec_frames]])
    torch.manual_seed(TOKEN2WAV_SEED)
    with torch.inference_mode():
        wav = token2wav(codes, conditioning=voice.cond, reference_mel=voice.ref_mel).reshape(-1)
    np.testing.assert_array_equal(wav.numpy(), text_result.audio)


@pytest.mark.exactness
def test_generate_is_deterministic_and_the_seed_moves_only_the_audio(runner, text_result):
    again = runner.generate(user(Part(text=PROMPT)), None, MAX_NEW_TOKENS, TALKER_MAX_NEW_TOKENS)
    assert again.thinker_token_ids == text_result.thinker_token_ids
    assert again.codec_frames == text_result.codec_frames
    np.testing.assert_array_equal(again.audio, text_result.audio)
    other = runner.generate(user(Part(text=PROMPT)), None, MAX_NEW_TOKENS, TALKER_MAX_NEW_TOKENS, seed=1)
    assert other.codec_frames == text_result.codec_frames
    assert rms(other.audio - text_result.audio) > 0.01


def test_voice_names_match_spk_dict_case_insensitively(runner, text_result):
    assert runner.voices == {"chelsie": "Chelsie", "ethan": "Ethan"}
    chelsie = runner.generate(user(Part(text=PROMPT)), "CHELSIE", MAX_NEW_TOKENS, TALKER_MAX_NEW_TOKENS)
    assert chelsie.codec_frames == text_result.codec_frames  # the default is generate's, Chelsie
    ethan = runner.generate(user(Part(text=PROMPT)), "ethan", MAX_NEW_TOKENS, TALKER_MAX_NEW_TOKENS)
    assert ethan.thinker_token_ids == text_result.thinker_token_ids  # the voice is the talker's business
    assert ethan.codec_frames != text_result.codec_frames  # its bos_token starts the talker's reply


def test_unknown_voice_is_invalid_argument(runner):
    with pytest.raises(InvalidArgument, match="Chelsie, Ethan") as err:
        runner.generate(user(Part(text=PROMPT)), "aiden", 2, 4)
    assert err.value.field == "voice"


@pytest.mark.parametrize("kinds", [("audio",), ("image",), ("audio", "image")], ids="+".join)
def test_media_prompt_generates(runner, kinds, wav_bytes, png_bytes):
    media = {"audio": Part(audio=wav_bytes), "image": Part(image=png_bytes)}
    messages = user(*(media[k] for k in kinds), Part(text="What is this?"))
    inputs = runner.inputs(messages)
    ids = inputs["input_ids"][0].tolist()
    tok = runner.processor.tokenizer
    assert ids.count(tok.convert_tokens_to_ids("<|AUDIO|>")) == (25 if "audio" in kinds else 0)
    assert ids.count(tok.convert_tokens_to_ids("<|IMAGE|>")) == (4 if "image" in kinds else 0)
    result = runner.generate(messages, None, 4, 8)
    assert len(result.thinker_token_ids) == 4 and len(result.codec_frames) == 8
    assert rms(result.audio) > 0.01


def test_text_only_and_forced_ids(runner):
    text_only = runner.generate(user(Part(text=PROMPT)), None, MAX_NEW_TOKENS, return_audio=False)
    assert len(text_only.thinker_token_ids) == MAX_NEW_TOKENS
    assert text_only.codec_frames == [] and len(text_only.audio) == 0
    forced = runner.generate(user(Part(text=PROMPT)), None, 1, 6, forced_ids=[10, 11, 12])
    assert forced.thinker_token_ids == [10, 11, 12] and len(forced.codec_frames) == 6


@pytest.mark.exactness
def test_sampling_is_seeded(runner, text_result):
    sampling = {"temperature": 1.0, "top_k": 50}
    first, second = (runner.generate(user(Part(text=PROMPT)), None, MAX_NEW_TOKENS, TALKER_MAX_NEW_TOKENS,
                                     thinker_sampling=sampling, talker_sampling=sampling, seed=5) for _ in range(2))
    assert first.thinker_token_ids == second.thinker_token_ids and first.codec_frames == second.codec_frames
    assert first.codec_frames != text_result.codec_frames


def test_transformers_generate_fails_on_a_one_token_reply(runner):
    """transformers quirk (docs/qwen2_5-omni.md): the talker's reply stream is built from the thinker's
    decode steps, and a one-token reply has none (torch.cat of an empty list), so the oracle has no
    answer for max_new_tokens=1 with audio; text alone works."""
    with pytest.raises(ValueError, match="non-empty list"):
        runner.generate(user(Part(text=PROMPT)), None, 1, 4)
    assert len(runner.generate(user(Part(text=PROMPT)), None, 1, return_audio=False).thinker_token_ids) == 1


def test_speaker_and_model_inputs_as_generate_takes_them(runner, png_bytes):
    assert runner.speaker(None) == "Chelsie" and runner.speaker("ETHAN") == "Ethan"
    inputs = runner.model_inputs(runner.inputs(user(Part(image=png_bytes), Part(text=PROMPT))))
    assert "thinker_pixel_values" in inputs and "pixel_values" not in inputs  # the talker must not get them


def test_cli_prints_one_json_object(tiny_qwen2_5_checkpoint, tmp_path, capsys):
    import json

    from services.tools.reference import main

    out = tmp_path / "a.wav"
    assert main(["--checkpoint", str(tiny_qwen2_5_checkpoint), "--prompt", PROMPT, "--voice", "chelsie",
                 "--max-new-tokens", "3", "--talker-max-new-tokens", "5", "--json", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert len(summary["thinker_token_ids"]) == 3 and summary["codec_frames"] and len(summary["codec_frames"]) == 5
    assert summary["audio_seconds"] == pytest.approx(5 * SAMPLES_PER_CODE / 24000)
    assert out.stat().st_size > 0
