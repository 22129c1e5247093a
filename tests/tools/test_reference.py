"""ReferenceRunner and the `omni-reference` CLI on the tiny checkpoint.

The tiny checkpoint's codec EOS logit is zero, so greedy decoding runs to the limits: 8 text
tokens, and 24 talker steps give 23 codec frames (transformers collects a frame's 16 codes when
the next step runs the code predictor, so the last step's token never gets a frame).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from services.base.errors import InvalidArgument, UserError
from services.runtime.inputs.prompt import ChatMessage, Part, Role
from services.tools.reference import ReferenceRunner, messages_from_args

MAX_NEW_TOKENS = 8
TALKER_MAX_NEW_TOKENS = 24
N_FRAMES = TALKER_MAX_NEW_TOKENS - 1
SHORT_TALKER_TOKENS = 8  # for the tests that only need some audio
PROMPT = "Hello! How are you today?"
REPO = Path(__file__).resolve().parents[2]

# transformers warns on every talker generate that the penalty skips the prompt; expected here.
pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")


def user(*parts: Part) -> list[ChatMessage]:
    return [ChatMessage(Role.USER, tuple(parts))]


def rms(audio: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(audio.astype(np.float64)))))


def samples_per_frame(config) -> int:
    # 2*2 (upsampling_ratios) * 8*5*4*3 (upsample_rates) = 1920 samples per 12.5 Hz frame at 24 kHz.
    cfg = config.code2wav_config
    return math.prod(cfg.upsampling_ratios) * math.prod(cfg.upsample_rates)


def lookahead_samples(config) -> int:
    # Each decoder block's causal transposed conv (kernel 2r, stride r) drops its last r outputs, the
    # samples that would overlap the next frame; later blocks upsample what was dropped:
    # 8*5*4*3 + 5*4*3 + 4*3 + 3 = 555 for rates (8, 5, 4, 3).
    rates = list(config.code2wav_config.upsample_rates)
    return sum(math.prod(rates[i:]) for i in range(len(rates)))


@pytest.fixture(scope="module")
def runner(tiny_checkpoint) -> ReferenceRunner:
    return ReferenceRunner(tiny_checkpoint)


@pytest.fixture(scope="module")
def text_result(runner):
    return runner.generate(user(Part(text=PROMPT)), None, MAX_NEW_TOKENS, TALKER_MAX_NEW_TOKENS)


def test_text_prompt_gives_tokens_frames_and_audio(runner, text_result):
    codebook = runner.config.code2wav_config.codebook_size
    groups = runner.config.talker_config.num_code_groups

    assert len(text_result.thinker_token_ids) == MAX_NEW_TOKENS
    assert text_result.text == runner.decode(text_result.thinker_token_ids)
    assert len(text_result.codec_frames) == N_FRAMES
    for frame in text_result.codec_frames:
        assert len(frame) == groups == 16
        assert all(isinstance(c, int) and 0 <= c < codebook for c in frame), frame
    assert text_result.audio.dtype == np.float32
    assert rms(text_result.audio) > 0.01
    assert text_result.sample_rate == 24000
    assert text_result.prompt_tokens > 0


def test_audio_length_is_frames_times_1920_minus_555_lookahead(runner, text_result):
    assert samples_per_frame(runner.config) == 1920
    assert lookahead_samples(runner.config) == 555
    assert len(text_result.audio) == N_FRAMES * 1920 - 555
    assert text_result.audio_seconds == len(text_result.audio) / 24000


@pytest.mark.exactness
def test_audio_equals_one_code2wav_forward_of_the_frames(runner, text_result):
    codes = torch.tensor(text_result.codec_frames).T.unsqueeze(0)  # [1, Q, frames]
    with torch.inference_mode():
        wav = runner.model.code2wav(codes).reshape(-1).numpy()
    assert wav.shape == text_result.audio.shape
    np.testing.assert_array_equal(wav, text_result.audio)


@pytest.mark.exactness
def test_generate_is_deterministic(runner, text_result):
    again = runner.generate(user(Part(text=PROMPT)), None, MAX_NEW_TOKENS, TALKER_MAX_NEW_TOKENS)
    assert again.thinker_token_ids == text_result.thinker_token_ids
    assert again.codec_frames == text_result.codec_frames
    np.testing.assert_array_equal(again.audio, text_result.audio)


def test_voice_selects_the_speaker(runner, text_result):
    # The default voice is ethan; another speaker id changes the talker's prompt, so its codes.
    # Greedy and causal: a shorter talker run gives a prefix of the frames of a longer one.
    ethan = runner.generate(user(Part(text=PROMPT)), "Ethan", MAX_NEW_TOKENS, SHORT_TALKER_TOKENS)
    assert ethan.codec_frames == text_result.codec_frames[: SHORT_TALKER_TOKENS - 1]
    chelsie = runner.generate(user(Part(text=PROMPT)), "chelsie", MAX_NEW_TOKENS, SHORT_TALKER_TOKENS)
    assert chelsie.thinker_token_ids == text_result.thinker_token_ids
    assert chelsie.codec_frames != ethan.codec_frames


def test_unknown_voice_is_invalid_argument(runner):
    with pytest.raises(InvalidArgument, match="nobody") as err:
        runner.generate(user(Part(text=PROMPT)), "nobody", 2, 3)
    assert err.value.field == "voice"


@pytest.mark.parametrize("kind", ["audio", "image"])
def test_media_prompt_generates(runner, kind, wav_bytes, png_bytes):
    media = Part(audio=wav_bytes) if kind == "audio" else Part(image=png_bytes)
    messages = user(media, Part(text="Describe it."))
    result = runner.generate(messages, None, MAX_NEW_TOKENS, SHORT_TALKER_TOKENS)
    assert len(result.thinker_token_ids) == MAX_NEW_TOKENS
    assert len(result.codec_frames) == SHORT_TALKER_TOKENS - 1
    assert len(result.audio) == (SHORT_TALKER_TOKENS - 1) * 1920 - 555
    assert rms(result.audio) > 0.01
    # The placeholder became one pad token per encoder output position, more than one.
    pad = runner.config.thinker_config.audio_token_id if kind == "audio" else runner.config.thinker_config.image_token_id
    ids = runner.inputs(messages)["input_ids"][0].tolist()
    assert ids.count(pad) > 1
    assert result.prompt_tokens == len(ids)


def test_messages_from_args_reads_files_in_order(wav_file, png_file):
    messages = messages_from_args("Hi", "Be brief.", wav_file, png_file)
    assert [m.role for m in messages] == [Role.SYSTEM, Role.USER]
    assert messages[0].parts == (Part(text="Be brief."),)
    audio, image, text = messages[1].parts
    assert audio.audio == wav_file.read_bytes()
    assert image.image == png_file.read_bytes()
    assert text == Part(text="Hi")
    assert messages_from_args("Hi", None, None, None) == user(Part(text="Hi"))


def test_messages_from_args_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="--image .*: file not found"):
        messages_from_args("Hi", None, None, tmp_path / "missing.png")


# --- the CLI: two real subprocesses (each pays ~5 s of imports, so they run at once); the other
# user mistakes go through the same main() and run_cli in this process ---

ERROR_CASES = {
    # case -> (extra arguments, a piece of the error line)
    "missing_checkpoint": (["--checkpoint", "{tmp}/no_such_folder"], "checkpoint folder not found"),
    "unknown_voice": (["--voice", "nobody"], "--voice: unknown voice 'nobody'"),
    "unreadable_audio": (["--audio", "{tmp}/not_audio.txt"], "not a readable wav/flac file"),
    "missing_audio": (["--audio", "{tmp}/missing.wav"], "file not found"),
}
SUBPROCESS_ERROR_CASE = "unknown_voice"


@pytest.fixture(scope="module")
def cli_tmp(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "not_audio.txt").write_text("this is not a wav file\n")
    return tmp


def cli_args(tiny_checkpoint, tmp: Path, extra: list[str]) -> list[str]:
    # Later flags win, so extra may override --checkpoint.
    base = ["--checkpoint", str(tiny_checkpoint), "--prompt", PROMPT, "--max-new-tokens", "4",
            "--talker-max-new-tokens", "6"]
    return base + [a.format(tmp=tmp) for a in extra]


@pytest.fixture(scope="module")
def cli_runs(tiny_checkpoint, cli_tmp):
    """The success case and one error case as concurrent subprocesses; case -> CompletedProcess."""
    commands = {
        "ok": cli_args(tiny_checkpoint, cli_tmp, ["--json", "--out", str(cli_tmp / "out" / "x.wav")]),
        SUBPROCESS_ERROR_CASE: cli_args(tiny_checkpoint, cli_tmp, ERROR_CASES[SUBPROCESS_ERROR_CASE][0]),
    }
    procs = {
        case: subprocess.Popen([sys.executable, "-m", "services.tools.reference", *args], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for case, args in commands.items()
    }
    runs = {}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        runs[case] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return runs


@pytest.mark.slow  # 13 s with the next: two CLI processes (cli_runs): make test-slow (CI)
def test_cli_json_prints_one_object_and_writes_a_wav(cli_runs, cli_tmp):
    import soundfile as sf

    run = cli_runs["ok"]
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout
    summary = json.loads(lines[0])
    assert {"text", "thinker_token_ids", "codec_frames", "audio_seconds", "sample_rate", "wall_s"} <= set(summary)
    assert len(summary["thinker_token_ids"]) == 4
    assert len(summary["codec_frames"]) == 5
    assert summary["sample_rate"] == 24000

    audio, rate = sf.read(str(cli_tmp / "out" / "x.wav"), dtype="float32")
    assert rate == 24000
    assert len(audio) == 5 * 1920 - 555
    assert summary["audio_seconds"] == pytest.approx(len(audio) / rate)
    assert rms(audio) > 0.01


def assert_one_error_line(stderr: str, expected: str) -> None:
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert stderr.rstrip().endswith(errors[0])  # the last thing printed
    assert expected in errors[0], errors[0]


@pytest.mark.slow  # shares cli_runs with the test above: make test-slow (CI)
def test_cli_process_exits_2_with_one_error_line(cli_runs):
    run = cli_runs[SUBPROCESS_ERROR_CASE]
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""
    assert_one_error_line(run.stderr, ERROR_CASES[SUBPROCESS_ERROR_CASE][1])


@pytest.mark.parametrize("case", [c for c in ERROR_CASES if c != SUBPROCESS_ERROR_CASE])
def test_cli_user_mistake_returns_2_with_one_error_line(tiny_checkpoint, cli_tmp, capsys, case):
    from services.tools.reference import main

    extra, expected = ERROR_CASES[case]
    assert main(cli_args(tiny_checkpoint, cli_tmp, extra)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_error_line(captured.err, expected)
