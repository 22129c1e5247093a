"""Cancellation and deadlines that would fail if a stage ignored the abort.

A long request (many codec frames, or many text tokens) is first run to its end to measure how
long it takes on this machine, then run again and cancelled (or given a deadline) early. Every
stage replica's GetLoad (in_flight, running, queue_depth) must drop to 0 well before the request
would have ended on its own: within half of the time it had left. A stage that kept generating
after the abort would stay busy for about all of that time. No fixed time bounds: only ratios of
measured durations, so a loaded machine slows both sides alike. Which stages held the request is
read from their GetLoad while the request is certainly still running (on the client's thread, at
the response the abort follows), not assumed.
"""

from __future__ import annotations

import time

import pytest

from services.tools.client import build_request
from services.tools.soak import Call, CancelPoint, CancelWhen, read_loads

from .support import assert_recovered

TALKER_FRAMES = 300  # long enough that the remaining time dwarfs the stages' reaction time
TEXT_TOKENS = 1000

pytestmark = pytest.mark.slow  # a stack of its own and each request run twice (about 40 s): make test-slow


def busy_stages(stack) -> set[str]:
    """Stages with a replica that has anything in flight, running or queued."""
    return {load.stage for load in read_loads(stack.replicas) if not load.idle}


def wait_idle(stack, limit_s: float) -> float:
    """perf_counter time at which every stage replica reported idle; fails past `limit_s` from now."""
    start = time.perf_counter()
    while busy_stages(stack):
        assert time.perf_counter() - start < limit_s, f"still busy after {limit_s:.1f} s: {busy_stages(stack)}"
        time.sleep(0.02)
    return time.perf_counter()


class SeenBusy:
    """`Call.on_response` hook: the stages busy when the call first reached `count` texts or audios."""

    def __init__(self, stack, kind: str, count: int = 1):
        self.stack, self.kind, self.count = stack, kind, count
        self.stages: set[str] | None = None

    def __call__(self, call: Call) -> None:
        if self.stages is None and getattr(call, self.kind) >= self.count:
            self.stages = busy_stages(self.stack)


def full_duration(omni, request) -> float:
    call = Call(omni.Generate, request, 600).run()
    assert call.code.name == "OK", (call.code, call.details)
    return call.seconds


def assert_freed_early(stack, call: Call, full_s: float, ended_at: float, stages: set[str], seen: SeenBusy) -> None:
    """`ended_at`: when the abort happened (cancel sent, or the deadline). `stages` must have been
    seen holding the request just before it (`seen`), and every stage must be idle within half of
    the time the request had left."""
    assert seen.stages is not None, f"the call never reached {seen.count} {seen.kind}"
    assert stages <= seen.stages, f"{stages - seen.stages} held nothing before the abort (busy: {seen.stages})"
    elapsed = ended_at - call.started
    remaining = full_s - elapsed
    assert remaining > 0.5 * full_s, f"aborted too late to tell: {elapsed:.2f} s of {full_s:.2f} s"
    idle_at = wait_idle(stack, limit_s=full_s)
    took = idle_at - ended_at
    assert took < remaining / 2, (f"stages idle {took:.2f} s after the abort; the request had {remaining:.2f} s "
                                  f"left (a stage ignoring the abort stays busy that long)")


def test_cancel_mid_audio_frees_every_stage_long_before_the_request_would_end(stack, omni):
    request = build_request("a long answer", max_new_tokens=8, talker_max_new_tokens=TALKER_FRAMES)
    full_s = full_duration(omni, request)
    seen = SeenBusy(stack, "audios")
    call = Call(omni.Generate, request, 600, CancelPoint(CancelWhen.AFTER_AUDIO, 1), on_response=seen).run()
    assert call.code.name == "CANCELLED", (call.code, call.details)
    # Both stages had the request when it was cancelled: their loads were read at the first audio
    # chunk, before the cancel, while the talker had most of its 300 frames to go
    # (assert_freed_early checks the cancel came in the first half). (The thinker's engine is done
    # after its 8 tokens, long before; it relays the audio.)
    assert call.audios >= 1 and call.final is None, "cancelled before any audio: nothing to abort"
    assert_freed_early(stack, call, full_s, call.cancelled_at, {"talker", "code2wav"}, seen)
    assert_recovered(stack, omni)


def test_cancel_mid_text_frees_the_thinker_long_before_the_request_would_end(stack, omni):
    request = build_request("a long text", text_only=True, max_new_tokens=TEXT_TOKENS)
    full_s = full_duration(omni, request)
    seen = SeenBusy(stack, "texts", 5)
    call = Call(omni.Generate, request, 600, CancelPoint(CancelWhen.AFTER_TEXT, 5), on_response=seen)
    call.run()
    assert call.code.name == "CANCELLED", (call.code, call.details)
    assert call.texts < TEXT_TOKENS / 2
    assert_freed_early(stack, call, full_s, call.cancelled_at, {"thinker"}, seen)
    assert_recovered(stack, omni)


def test_a_deadline_mid_audio_frees_every_stage_long_before_the_request_would_end(stack, omni):
    request = build_request("a long answer", max_new_tokens=8, talker_max_new_tokens=TALKER_FRAMES)
    full_s = full_duration(omni, request)
    deadline_s = full_s / 5
    seen = SeenBusy(stack, "audios")
    call = Call(omni.Generate, request, deadline_s, on_response=seen).run()
    assert call.code.name == "DEADLINE_EXCEEDED", (call.code, call.details)
    assert call.audios >= 1, "the deadline passed before any audio: the stages had nothing to abort"
    assert_freed_early(stack, call, full_s, call.started + deadline_s, {"talker", "code2wav"}, seen)
    assert_recovered(stack, omni)
