"""Sampling through the real stack: a seeded request draws what transformers' generate draws from a
generator seeded the same, and the same tokens on every run, alone or batched with others.

generate draws every sampled token of a stage with `torch.multinomial` from torch's global
generator; each engine draws a request's tokens from its own generator seeded with the request's
seed, in the same order (talker: layer-0 code, then the code predictor's residuals, frame by frame).
The scores are transformers' bit for bit (tests/runtime/lm/test_sampling_vs_transformers.py), so the
tokens must be equal, not just similar.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from omni.v1 import common_pb2, omni_pb2
from services.runtime.inputs.prompt import ChatMessage, Part, Role
from services.tools.client import build_request, collect

pytestmark = pytest.mark.exactness

PROMPT = "Once upon a time there was a small model"
THINKER = dict(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1)
TALKER = dict(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)  # generate's talker defaults


def sampled(prompt: str, thinker: dict | None, talker: dict | None, thinker_seed: int | None = None,
            talker_seed: int | None = None, text_only: bool = False, max_new_tokens: int = 20,
            talker_max_new_tokens: int = 30) -> omni_pb2.GenerateRequest:
    request = build_request(prompt, text_only=text_only, max_new_tokens=max_new_tokens,
                            talker_max_new_tokens=None if text_only else talker_max_new_tokens,
                            return_codec_frames=not text_only)
    for field, params, seed in (("thinker_sampling", thinker, thinker_seed), ("talker_sampling", talker, talker_seed)):
        target = getattr(request, field)
        for key, value in (params or {}).items():
            setattr(target, key, value)
        if seed is not None:
            target.seed = seed
    return request


def user(prompt: str) -> list[ChatMessage]:
    return [ChatMessage(Role.USER, (Part(text=prompt),))]


def test_seeded_thinker_sampling_draws_what_generate_draws(omni, reference):
    expected = reference.generate(user(PROMPT), max_new_tokens=20, return_audio=False, thinker_sampling=THINKER,
                                  seed=7)
    got = collect(omni, sampled(PROMPT, THINKER, None, thinker_seed=7, text_only=True), timeout=120)
    assert got.thinker_token_ids == expected.thinker_token_ids
    greedy = reference.generate(user(PROMPT), max_new_tokens=20, return_audio=False)
    assert got.thinker_token_ids != greedy.thinker_token_ids  # it really sampled


def test_seeded_talker_sampling_draws_what_generate_draws(omni, reference):
    expected = reference.generate(user(PROMPT), voice="ethan", max_new_tokens=10, talker_max_new_tokens=30,
                                  talker_sampling=TALKER, seed=11)
    got = collect(omni, sampled(PROMPT, None, TALKER, talker_seed=11, max_new_tokens=10), timeout=120)
    assert got.thinker_token_ids == expected.thinker_token_ids
    assert got.codec_frames == expected.codec_frames
    # This seed draws the codec EOS after a few frames (its logit is 0 on the tiny checkpoint, so only
    # sampling reaches it): the talker's STOP path, as generate.
    assert len(got.codec_frames) < 29
    assert got.final.audio_finish_reason == common_pb2.FINISH_REASON_STOP
    assert got.final.usage.codec_frames == len(expected.codec_frames)
    greedy = reference.generate(user(PROMPT), voice="ethan", max_new_tokens=10, talker_max_new_tokens=30)
    assert got.codec_frames != greedy.codec_frames  # it really sampled


def test_a_seeded_request_draws_the_same_tokens_alone_and_batched(omni):
    seeded = sampled(PROMPT, THINKER, TALKER, thinker_seed=3, talker_seed=4)
    first = collect(omni, seeded, timeout=120)
    again = collect(omni, seeded, timeout=120)
    others = [sampled(f"Request {i}: tell me something", THINKER if i % 2 else None, TALKER, thinker_seed=100 + i,
                      talker_seed=200 + i, max_new_tokens=8 + i, talker_max_new_tokens=12 + 3 * i) for i in range(5)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        batched = list(pool.map(lambda r: collect(omni, r, timeout=300), [seeded, seeded, seeded] + others))
    reference_run = (first.thinker_token_ids, first.codec_frames)
    for i, run in enumerate([again] + batched[:3]):
        assert (run.thinker_token_ids, run.codec_frames) == reference_run, f"run {i} of the seeded request differs"
    other_seed = collect(omni, sampled(PROMPT, THINKER, TALKER, thinker_seed=5, talker_seed=6), timeout=120)
    assert other_seed.thinker_token_ids != first.thinker_token_ids
    assert other_seed.codec_frames != first.codec_frames
