"""Audio first on the real stack (the thinker's `--audio-first`, on by default on CPU): a spoken
request's text is held at what the talker's first chunk needs plus a margin until the talker
answers, then runs to its end; text-only requests and short speech are not held back."""

from __future__ import annotations

import grpc
import pytest

from omni.v1 import common_pb2, stages_pb2_grpc
from services.thinker.server import AUDIO_FIRST_HOLD_S, AUDIO_FIRST_MARGIN
from services.tools.client import build_request, collect

FIRST_CHUNK = 4  # the talker's default --first-chunk-frames
TOKENS = 32

pytestmark = pytest.mark.slow  # a stack of its own (about 30 s on 2 cores): make test-slow


def text_before_first_audio(omni, request):
    """(text tokens the client had when the first audio came, the whole result)."""
    seen: list[int] = []

    def on_event(kind, response, result):
        if kind == "audio" and not seen:
            seen.append(len(result.thinker_token_ids))
    result = collect(omni, request, timeout=120, on_event=on_event)
    return seen[0], result


def test_the_talker_reports_the_rows_its_first_chunk_needs(stack):
    with grpc.insecure_channel(stack.addresses("talker")[0]) as channel:
        report = stages_pb2_grpc.TalkerStub(channel).GetLoad(common_pb2.LoadRequest(), timeout=10)
    assert report.limits.text_rows_to_first_chunk == FIRST_CHUNK


def test_text_is_held_near_the_talker_until_its_first_audio(omni):
    lead = FIRST_CHUNK + AUDIO_FIRST_MARGIN
    for i in range(3):
        before, result = text_before_first_audio(
            omni, build_request(f"question {i}: tell me about the sea", max_new_tokens=TOKENS, talker_max_new_tokens=64))
        assert len(result.thinker_token_ids) == TOKENS and result.final.usage.codec_frames == 63  # then ran to its end
        # The hold gives way after AUDIO_FIRST_HOLD_S, so on a machine that slow more text may come first.
        assert before <= lead or result.final.timings.ttfp_ms >= AUDIO_FIRST_HOLD_S * 1000, (before, result.final.timings)


def test_speech_shorter_than_the_first_chunk_and_text_only_requests_finish(omni):
    short = collect(omni, build_request("hi", max_new_tokens=TOKENS, talker_max_new_tokens=2), timeout=120)
    assert len(short.thinker_token_ids) == TOKENS and short.final.usage.codec_frames == 1
    text = collect(omni, build_request("hi", text_only=True, max_new_tokens=TOKENS), timeout=120)
    assert len(text.thinker_token_ids) == TOKENS
