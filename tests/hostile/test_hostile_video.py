"""Hostile videos against the stack: a resolution bomb (100 KB declaring 9.4 M pixels a frame), a
duration bomb (two frames an hour apart), a frame-count bomb (470 KB declaring 36001 frames), a
truncated container and a codec the thinker does not take are each refused INVALID_ARGUMENT naming
the part, before a frame is decoded where the header tells, and the stack keeps serving. A video
exactly at the frame-size bound is served within its documented memory. (Each bound at its exact
value: tests/runtime/inputs/test_video_input.py.)"""

from __future__ import annotations

import pytest

from services.tools.client import build_request
from services.tools.synthetic_video import video

from .support import PeakRss
from .test_hostile_input import MB, assert_still_serving, refused

FIELD = "messages[0].content[0].video"


@pytest.fixture(scope="module")
def bombs() -> dict[str, tuple[bytes, str]]:
    clip = video(frames=12)
    return {
        "resolution": (video(frames=1, width=4096, height=2304, fps=1, flat=True, codec="mpeg4"),
                       "9437184 pixels (4096x2304)"),
        "duration": (video(frames=2, width=16, height=16, fps=6, flat=True, last_at_s=3600.0), "longer than 600"),
        # 36001 frames at 120 fps: 300 s, under the duration bound; one frame over the frame bound.
        "frames": (video(frames=36001, width=16, height=16, fps=120, flat=True, codec="mpeg4"),
                   "declares 36001 frames, more than 36000"),
        "truncated": (clip[:len(clip) // 2], "not a readable mp4/webm video"),
        "codec": (video(frames=2, codec="mjpeg"), "video codec mjpeg"),
    }


@pytest.mark.parametrize("kind", ["resolution", "duration", "frames", "truncated", "codec"])
def test_a_hostile_video_is_refused_naming_the_part_and_the_stack_keeps_serving(stack, omni, bombs, kind):
    data, reason = bombs[kind]
    with PeakRss(stack.popen("thinker-0").pid) as rss:
        details = refused(omni, build_request("what happens?", video=data), FIELD)
    assert reason in details, details
    assert rss.growth < 32 * MB, rss.growth  # decoding the bomb's one frame would take 9.4 M x 3 bytes and more
    assert_still_serving(stack, omni)


def test_a_video_at_the_frame_size_bound_is_served_within_its_memory_bound(stack, omni, tiny_checkpoint):
    """3840x2160, exactly the default --max-video-pixels (one pixel row more is the resolution
    bomb's refusal), 4 frames sampled: served, and the thinker's peak resident growth stays within
    the video's build bound (`build_bytes`, docs/video.md: 86 MB here) and the rest of the request:
    its prefill of 1460 prompt tokens and the request's copies, under 96 MB on the tiny checkpoint
    (measured: 150 MB in all for a fresh thinker, 45 MB once it built one such video)."""
    import grpc
    from transformers import AutoConfig

    from services.runtime.inputs.prompt import Part, PromptBuilder
    from services.runtime.inputs.video import VideoLimits, build_bytes
    from services.tools.soak import Call

    clip = video(frames=4, width=3840, height=2160, fps=2, flat=True, codec="mpeg4")
    builder = PromptBuilder(tiny_checkpoint, AutoConfig.from_pretrained(tiny_checkpoint))
    header = builder._declared_video(Part(video=clip), FIELD)
    assert header.width * header.height == VideoLimits().max_pixels
    bound = build_bytes(builder.video_rules, header) + 96 * MB
    with PeakRss(stack.popen("thinker-0").pid) as rss:
        call = Call(omni.Generate, build_request("what happens?", video=clip, text_only=True, max_new_tokens=2),
                    120).run()
    assert call.code is grpc.StatusCode.OK, (call.code, call.details)
    assert call.final.usage.prompt_tokens > 1400  # 2 x 40 x 72 patches (640x1152), 4 to a token, and the text
    print(f"thinker growth {rss.growth / MB:.0f} MB, bound {bound / MB:.0f} MB")
    assert rss.growth <= bound, (rss.growth / MB, bound / MB)
    assert_still_serving(stack, omni)
