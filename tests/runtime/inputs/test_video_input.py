"""Video parts in PromptBuilder: hostile videos are refused from the header before a frame is
decoded, each limit holds exactly at its bound, and the prompt's tokens (so its memory) are known
before decoding. Videos are made here with PyAV (services/tools/synthetic_video.py)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

import services.runtime.inputs.prompt as prompt_module
from services.base.errors import ContextFull, InvalidArgument
from services.runtime.inputs.prompt import ChatMessage, Part, PromptBuilder, PromptLimits, Role
from services.runtime.inputs.video import VideoLimits, bytes_per_token, video_grid, video_tokens
from services.tools.synthetic_video import video

FIELD = "messages[0].content[0].video"


def wav_of_silence() -> bytes:
    import io

    import numpy as np
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.zeros(8000, np.float32), 16000, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def clip() -> bytes:
    return video(frames=12, width=64, height=48, fps=6)  # 2.0 s, 3072 pixels a frame


@pytest.fixture(scope="module")
def builder(tiny_checkpoint):
    return PromptBuilder(tiny_checkpoint, AutoConfig.from_pretrained(tiny_checkpoint))


def build(builder, data: bytes, limits: PromptLimits = PromptLimits(), use_audio: bool = False):
    return builder.with_limits(limits).build(
        [ChatMessage(Role.USER, (Part(video=data, use_audio_in_video=use_audio), Part(text="hi")))])


def refused(builder, data: bytes, limits: PromptLimits = PromptLimits(), use_audio: bool = False) -> str:
    with pytest.raises(InvalidArgument) as info:
        build(builder, data, limits, use_audio)
    assert info.value.field == FIELD, info.value
    return info.value.description


@pytest.fixture
def no_decoding(monkeypatch):
    """Any decode of a video fails the test: what is refused is refused from the header."""
    def decode(*args, **kwargs):
        raise AssertionError("decoded a video that the header should have refused")
    monkeypatch.setattr(prompt_module, "decode_video", decode)


@pytest.mark.parametrize("limit, field, value", [
    ("max_pixels", "pixels", 64 * 48), ("max_frames", "frames", 12), ("max_seconds", "s", 2.0)])
def test_each_video_limit_holds_exactly_at_its_bound(limit, field, value, clip, builder):
    at = PromptLimits(video=VideoLimits(**{**vars(VideoLimits()), limit: value}))
    assert build(builder, clip, at).video_grid_thw.tolist() == [[2, 20, 28]]
    over = value - 1 if isinstance(value, int) else value - 0.1
    details = refused(builder, clip, PromptLimits(video=VideoLimits(**{**vars(VideoLimits()),
                                                                                      limit: over})))
    assert str(over) in details or f"{over:.1f}" in details, details


def test_a_resolution_bomb_is_refused_from_its_header(builder, no_decoding):
    bomb = video(frames=1, width=4096, height=2304, fps=1, flat=True, codec="mpeg4")  # ~100 KB, 9.4 M pixels
    assert len(bomb) < 200_000
    details = refused(builder, bomb)
    assert "9437184 pixels (4096x2304)" in details and str(3840 * 2160) in details, details


def test_frame_count_and_duration_bombs_are_refused_from_the_header(builder, no_decoding):
    long_flat = video(frames=240, width=32, height=32, fps=120, flat=True)  # declares 240 frames, 2 s
    details = refused(builder, long_flat, PromptLimits(video=VideoLimits(max_frames=239)))
    assert "240 frames" in details, details
    details = refused(builder, long_flat, PromptLimits(video=VideoLimits(max_seconds=1.5)))
    assert "2.0 s" in details and "1.5" in details, details


def test_a_truncated_container_is_invalid_argument(clip, builder):
    for cut in (200, len(clip) // 2, len(clip) - 100):  # no index / index gone / frames cut short
        details = refused(builder, clip[:cut])
        assert "mp4/webm" in details or "truncated" in details, details
    webm = video(frames=12, container="webm")
    assert "truncated" in refused(builder, webm[:len(webm) // 2])


def test_a_codec_or_container_not_taken_is_invalid_argument(builder, no_decoding):
    assert "video codec mjpeg" in refused(builder, video(frames=4, codec="mjpeg"))
    assert "not a readable mp4/webm" in refused(builder, b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64)
    assert "container wav" in refused(builder, wav_of_silence())


def test_use_audio_in_video_needs_a_track_and_one_value_for_every_video(clip, builder):
    assert "no audio track" in refused(builder, clip, use_audio=True)
    with pytest.raises(InvalidArgument) as info:
        builder.build([ChatMessage(Role.USER, (Part(video=clip), Part(video=clip, use_audio_in_video=True)))])
    assert info.value.field == "use_audio_in_video"


def test_the_prompt_limit_counts_video_tokens_from_the_header_so_memory_is_bounded_before_decoding(
        clip, builder, monkeypatch):
    header = builder._declared_video(Part(video=clip), FIELD)
    tokens = video_tokens(builder.video_rules, video_grid(builder.video_rules, header, FIELD))
    exact = build(builder, clip).num_tokens
    assert tokens == 2 * 20 * 28 // 4 and exact > tokens
    # At the limit it is served; one token under, refused before any frame is decoded.
    assert build(builder, clip, PromptLimits(max_prompt_tokens=exact)).num_tokens == exact
    monkeypatch.setattr(prompt_module, "decode_video", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(InvalidArgument) as info:
        build(builder, clip, PromptLimits(max_prompt_tokens=tokens - 1))
    assert info.value.field == "messages" and isinstance(info.value, ContextFull)  # a session truncates on it
    # The float32 patches a video token holds (tiny checkpoint: 16-pixel patches, 2 frames, 2x2 merge).
    assert bytes_per_token(builder.video_rules) == 4 * 4 * 3 * 2 * 16 * 16


def test_webm_and_the_audio_track_decode(builder):
    webm = build(builder, video(frames=12, container="webm", audio_seconds=2.0, audio_rate=48000),
                 use_audio=True)
    assert webm.video_grid_thw.tolist() == [[2, 20, 28]]
    assert webm.use_audio_in_video and webm.input_features is not None
    cfg = builder.config.thinker_config
    ids = webm.input_ids[0].tolist()
    assert ids.count(cfg.video_token_id) == 280 and ids.count(cfg.audio_token_id) > 0


def test_video_frames_are_checked_from_their_headers(builder, no_decoding):
    from services.tools.synthetic_video import frame_images

    frames = frame_images(frames=6)
    field = "messages[0].content[0].video_frames"

    def frames_refused(part: Part, limits: PromptLimits = PromptLimits()) -> InvalidArgument:
        with pytest.raises(InvalidArgument) as info:
            builder.with_limits(limits).build([ChatMessage(Role.USER, (part,))])
        return info.value

    odd = frames[:3] + frame_images(frames=1, width=48, height=64) + frames[3:]
    assert frames_refused(Part(video_frames=odd, video_fps=6.0)).field == f"{field}.frames[3]"
    assert frames_refused(Part(video_frames=frames, video_fps=0.0)).field == f"{field}.fps"
    error = frames_refused(Part(video_frames=frames, video_fps=6.0), PromptLimits(video=VideoLimits(max_frames=5)))
    assert error.field == f"{field}.frames" and "6 frames, more than 5" in error.description
    error = frames_refused(Part(video_frames=frames, video_fps=6.0, use_audio_in_video=True))
    assert error.field == field and "no audio track" in error.description
    error = frames_refused(Part(video_frames=frames[:1], video_fps=6.0))  # fewer than one temporal patch
    assert error.field == field and "fewer than the 2" in error.description


BUILD_AT_THE_BOUND = """
import json, os, sys
from transformers import AutoConfig
from services.runtime.inputs.prompt import ChatMessage, Part, PromptBuilder, Role
from services.runtime.inputs.video import VideoLimits, build_bytes
from services.tools.synthetic_video import video

def status(key):
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

builder = PromptBuilder(sys.argv[1], AutoConfig.from_pretrained(sys.argv[1]))
warm = video(frames=4, width=64, height=48, fps=2)  # PyAV's and torch's first use, not the video's
builder.build([ChatMessage(Role.USER, (Part(video=warm), Part(text="hi")))])
clip = video(frames=4, width=3840, height=2160, fps=2, flat=True, codec="mpeg4")  # 100 KB
header = builder._declared_video(Part(video=clip), "video")
assert header.width * header.height <= VideoLimits().max_pixels
with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) from here
start = status("VmRSS")
built = builder.build([ChatMessage(Role.USER, (Part(video=clip), Part(text="hi")))])
print(json.dumps({"growth": status("VmHWM") - start, "bound": build_bytes(builder.video_rules, header),
                  "pixels": header.width * header.height, "tokens": built.num_tokens}))
"""


@pytest.mark.slow  # 12 s: a process of its own that builds a 4K video: make test-slow (CI)
def test_memory_to_build_a_video_at_the_pixel_bound_is_the_documented_bound(tiny_checkpoint):
    """A 3840x2160 video (exactly the default --max-video-pixels), 4 frames sampled, built in a
    process of its own (so that the heap is the build's alone): the peak resident growth stays
    within `build_bytes` (docs/video.md's formula: one full-size frame, the sampled frames twice in
    uint8, the float32 patches; 90 MB here, measured 90 MB)."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", BUILD_AT_THE_BOUND, str(tiny_checkpoint)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["pixels"] == VideoLimits().max_pixels == 3840 * 2160, got
    print({k: f"{v / 2**20:.1f} MB" if k in ("growth", "bound") else v for k, v in got.items()})
    assert got["growth"] <= got["bound"] + (4 << 20), got
