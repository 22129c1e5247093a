"""Hostile videos against the stack: a resolution bomb (100 KB declaring 9.4 M pixels a frame), a
duration bomb (two frames an hour apart), a truncated container and a codec the thinker does not take are each refused
INVALID_ARGUMENT naming the part, before a frame is decoded where the header tells, and the stack
keeps serving. (Each bound at its exact value: tests/common/test_video_input.py.)"""

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
        "truncated": (clip[:len(clip) // 2], "not a readable mp4/webm video"),
        "codec": (video(frames=2, codec="mjpeg"), "video codec mjpeg"),
    }


@pytest.mark.parametrize("kind", ["resolution", "duration", "truncated", "codec"])
def test_a_hostile_video_is_refused_naming_the_part_and_the_stack_keeps_serving(stack, omni, bombs, kind):
    data, reason = bombs[kind]
    with PeakRss(stack.popen("thinker-0").pid) as rss:
        details = refused(omni, build_request("what happens?", video=data), FIELD)
    assert reason in details, details
    assert rss.growth < 32 * MB, rss.growth  # decoding the bomb's one frame would take 9.4 M x 3 bytes and more
    assert_still_serving(stack, omni)
