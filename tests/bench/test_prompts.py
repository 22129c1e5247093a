"""The prompt set: built in, or JSONL with optional audio / image files next to it."""

from __future__ import annotations

import json

import pytest

from bench.prompts import built_in_prompts, load_jsonl
from services.base.errors import UserError
from services.runtime.inputs.prompt import Role


def test_built_in_prompts_are_text_and_one_video_with_a_system_turn():
    prompts = built_in_prompts()
    assert len(prompts) >= 5
    assert [p.modalities for p in prompts] == ["text"] * (len(prompts) - 1) + ["text+video"]
    assert [m.role for m in prompts[0].messages()] == [Role.SYSTEM, Role.USER]
    assert prompts[-1].messages()[-1].parts[0].video == prompts[-1].video


def test_jsonl_reads_relative_media_paths_from_the_files_folder(tmp_path, wav_bytes, png_bytes):
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.wav").write_bytes(wav_bytes)
    (tmp_path / "media" / "b.png").write_bytes(png_bytes)
    lines = [{"prompt": "Hi"}, {}, {"prompt": "Hear?", "system": "Be brief.", "audio": "media/a.wav"},
             {"prompt": "See?", "image": str(tmp_path / "media" / "b.png")}]
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join("" if not line else json.dumps(line) for line in lines))
    prompts = load_jsonl(path)
    assert [p.modalities for p in prompts] == ["text", "text+audio", "text+image"]
    assert prompts[1].audio == wav_bytes and prompts[1].system == "Be brief."
    assert prompts[2].image == png_bytes
    user = prompts[1].messages()[-1]
    assert user.parts[0].audio == wav_bytes and user.parts[-1].text == "Hear?"


@pytest.mark.parametrize("line, message", [
    ('{"prompt": ', "set.jsonl:1: not valid JSON"),
    ('{"text": "hi"}', 'non-empty "prompt"'),
    ('{"prompt": "hi", "movie": "v.mp4"}', "unknown keys ['movie']"),
    ('{"prompt": "hi", "video": "missing.mp4"}', "video file not found"),
    ('{"prompt": "hi", "audio": "missing.wav"}', "audio file not found"),
])
def test_jsonl_mistakes_name_the_line(tmp_path, line, message):
    path = tmp_path / "set.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_jsonl(path)


def test_missing_or_empty_prompt_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="file not found"):
        load_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="no prompts"):
        load_jsonl(tmp_path / "empty.jsonl")
