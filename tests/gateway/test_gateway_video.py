"""A `video_url` part with a data: URL, as vLLM's OpenAI server takes it, and vLLM's
`mm_processor_kwargs: {"use_audio_in_video": true}`: the same prompt and reply as the router's gRPC
answer to the same video; a video the thinker refuses is a 400 naming the part."""

from __future__ import annotations

import base64

import openai
import pytest

from services.tools.client import build_request, collect
from services.tools.synthetic_video import video
from tests.gateway.test_gateway_chat import reply
from tests.gateway.test_gateway_errors import error_of


def data_url(clip: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(clip).decode()


@pytest.mark.parametrize("use_audio", [False, True])
def test_video_url_data_part_equals_the_grpc_answer(client, omni, use_audio):
    clip = video(frames=12, width=64, height=48, fps=6, audio_seconds=2.0)
    want = collect(omni, build_request("What happens?", video=clip, use_audio_in_video=use_audio, text_only=True,
                                       max_new_tokens=6), timeout=120)
    content = [{"type": "video_url", "video_url": {"url": data_url(clip)}}, {"type": "text", "text": "What happens?"}]
    got = client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], max_tokens=6,
                                         extra_body={"mm_processor_kwargs": {"use_audio_in_video": use_audio}})
    assert got.choices[0].message.content == reply(want)
    assert got.usage.prompt_tokens == want.final.usage.prompt_tokens > 280  # the video's 280 pads at least


@pytest.mark.parametrize("part, extra, param", [
    ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, None, "messages[0].content[0].video_url.url"),
    ({"type": "video_url", "video_url": {"url": data_url(b"\x00\x00\x00\x18ftypmp42")}}, None,
     "messages[0].content[0].video_url"),  # unreadable: the thinker says so
    ({"type": "video_url", "video_url": {"url": data_url(video(frames=4))}}, {"use_audio_in_video": True},
     "messages[0].content[0].video_url"),  # no audio track to hear
    ({"type": "text", "text": "hi"}, {"do_sample_frames": False}, "mm_processor_kwargs"),
])
def test_a_bad_video_part_is_400_naming_it(client, part, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": [part]}], max_tokens=4,
                                       extra_body={"mm_processor_kwargs": extra} if extra else None)
    error = error_of(caught.value)
    assert caught.value.status_code == 400 and error["param"] == param, error


def test_omni_client_video_flag_sends_the_file_and_its_track(gw_stack, omni, tmp_path, capsys):
    import json

    from services.tools import client as omni_client

    clip = video(frames=12, width=64, height=48, fps=6, audio_seconds=2.0, seed=3)
    (tmp_path / "clip.mp4").write_bytes(clip)
    want = collect(omni, build_request("Heard?", video=clip, use_audio_in_video=True, text_only=True,
                                       max_new_tokens=5), timeout=120)
    assert omni_client.main(["--target", gw_stack.target, "--video", str(tmp_path / "clip.mp4"),
                             "--use-audio-in-video", "--prompt", "Heard?", "--text-only", "--max-new-tokens", "5",
                             "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["thinker_token_ids"] == want.thinker_token_ids and got["thinker_token_ids"]
    assert omni_client.main(["--target", gw_stack.target, "--video", str(tmp_path / "none.mp4"), "--prompt", "x"]) == 2
    assert "--video" in capsys.readouterr().err
