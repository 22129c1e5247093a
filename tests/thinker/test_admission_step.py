"""Admission in one step (services/runtime/lm/scheduler.py, engine.py `admit`, packing.py), the
thinker of both families: a burst of prompts is prefilled in one step, packed into one forward
where exact batching is off (text prompts; media and prefix-cache hits alone beside it), each with
the tokens it gets alone; a prompt longer than the step's token budget is prefilled a chunk a step,
the running requests decoding between its chunks, with the whole prefill's bits in gemm mode (text,
audio and image, cuts inside the media); a request cancelled mid-chunk frees its slot and leaves
nothing in the prefix pool."""

from __future__ import annotations

import dataclasses

import pytest

from omni.v1 import omni_pb2
from services.base.events import RequestFailed
from services.base.families import family_of
from services.runtime.lm.sampling import SamplingConfig
from services.thinker.admission import messages_from_proto
from services.thinker.engine import ThinkerEngineConfig, Token
from services.thinker.server import ADAPTERS
from tests.thinker.test_prefix_conversation import (  # noqa: F401 - fixtures
    assert_same_bits,
    conversation,
    job,
    run,
)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_torch_thread")]

TEXTS = ("Hello!", "Tell me a story about a robot who learns to paint, in three sentences please.",
         "What is two plus two?", "Name a colour.", "Describe the sea at night, the moon above it and the boats.",
         "Why is the sky blue? Answer like a physicist would, with care.")


def engine(family_, *, exact: str = "off", prefills: int = 0, budget: int = 0, cache_mb: int = 0):
    config = ThinkerEngineConfig(max_batch_size=8, num_slots=8, max_model_len=768, exact_batching=exact != "off",
                                 exact_gemm=exact == "gemm", max_prefills_per_step=prefills, max_prefill_tokens=budget,
                                 prefix_cache_mb=cache_mb)
    return ADAPTERS[family_of(family_.checkpoint)].engine(family_.thinker.model, family_.thinker.config,
                                                          engine_config=config)


def text_job(family_, text: str, max_new_tokens: int = 4):
    request = omni_pb2.GenerateRequest()
    request.messages.add(role=omni_pb2.ROLE_USER).content.add(text=text)
    prompt = family_.builder.build(messages_from_proto(request))
    return family_.adapter.job(prompt, SamplingConfig(max_new_tokens=max_new_tokens), True, (),
                               family_.adapter.resolve_voice(None))


def count_forwards(engine_) -> list[int]:
    """The number of tokens of every call of the thinker model (appended as they happen)."""
    calls: list[int] = []
    handle = engine_.model.register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    engine_._count_handle = handle
    return calls


def test_a_burst_of_text_prompts_is_prefilled_in_one_forward_with_each_prompt_s_tokens(family):
    jobs = {f"r{i}": text_job(family, text) for i, text in enumerate(TEXTS)}
    alone = run(engine(family, prefills=1), jobs)
    packed_engine = engine(family)
    calls = count_forwards(packed_engine)
    for rid, j in jobs.items():
        packed_engine.add(rid, j)
    first = packed_engine.step()
    assert {rid for rid, event in first if isinstance(event, Token)} == set(jobs)  # every one admitted now
    assert calls == [sum(j.prompt.num_tokens for j in jobs.values())]  # in one forward
    packed_engine._count_handle.remove()
    tokens = {rid: [e.token_id for r, e in first if r == rid and isinstance(e, Token)] for rid in jobs}
    while packed_engine.has_work():
        for rid, event in packed_engine.step():
            if isinstance(event, Token):
                tokens[rid].append(event.token_id)
    assert tokens == {rid: out.tokens for rid, out in alone.items()}


def test_a_mixed_burst_packs_its_text_prompts_and_prefills_media_and_hits_alone(family, wav_bytes, png_bytes):
    jobs = {f"t{i}": text_job(family, text) for i, text in enumerate(TEXTS[:3])}
    jobs |= {"audio": job(family, conversation(1, wav_bytes, png_bytes)),
             "image": job(family, conversation(2, wav_bytes, png_bytes))}
    alone = run(engine(family, prefills=1, cache_mb=16), jobs)
    burst = engine(family, cache_mb=16)
    run(burst, {"history": job(family, conversation(2, wav_bytes, png_bytes))})  # the pool holds turn 2's blocks
    calls = count_forwards(burst)
    got = run(burst, jobs)
    burst._count_handle.remove()
    assert sum(j.prompt.num_tokens for rid, j in jobs.items() if rid.startswith("t")) in calls  # the text, packed
    assert burst.prefix_pool.stats.hit_tokens > 0  # "image" (turn 2 again) from the pool, alone
    assert {rid: out.tokens for rid, out in got.items()} == {rid: out.tokens for rid, out in alone.items()}


@pytest.mark.exactness
def test_a_prompt_over_the_budget_is_prefilled_a_chunk_a_step_with_the_whole_prefill_s_bits(family, wav_bytes, png_bytes):
    """gemm mode: every linear layer and the attention give a row the same bits for any row count, so
    a chunk after the cached keys of earlier chunks is the whole prefill's (as a prefix hit is)."""
    jobs = {"text": text_job(family, " ".join(TEXTS)), "audio": job(family, conversation(1, wav_bytes, png_bytes)),
            "image": job(family, conversation(2, wav_bytes, png_bytes))}
    for rid, j in jobs.items():
        whole = run(engine(family, exact="gemm"), {rid: j})[rid]
        chunked = engine(family, exact="gemm", budget=16)
        calls = count_forwards(chunked)  # a chunk's call takes the whole prompt's token ids, cut inside
        encoded = []  # the media encoders run for the first chunk only: later ones take its inputs
        hooks = [getattr(chunked.model, tower).register_forward_hook(
                 lambda *_, encoded=encoded, calls=calls: encoded.append(len(calls)))
                 for tower in ("audio_tower", "visual")]
        got = run(chunked, {rid: j})[rid]
        chunked._count_handle.remove()
        for hook in hooks:
            hook.remove()
        assert calls.count(j.prompt.num_tokens) == -(-j.prompt.num_tokens // 16) > 1, rid
        assert set(encoded) == ({1} if rid != "text" else set()), rid  # during the first model call
        assert_same_bits(got, whole, rid)


def test_running_requests_decode_between_a_long_prompt_s_chunks(family):
    engine_ = engine(family, budget=16)
    engine_.add("running", text_job(family, "Hi.", max_new_tokens=40))
    engine_.step()  # prefilled: it decodes from now on
    long_job = text_job(family, " ".join(TEXTS))
    engine_.add("long", long_job)
    chunks = -(-long_job.prompt.num_tokens // 16)
    for step in range(chunks):
        events = engine_.step()
        assert any(rid == "running" and isinstance(e, Token) for rid, e in events), step  # a token every step
        assert any(rid == "long" for rid, _ in events) is (step == chunks - 1), step  # the long one's first at the end


def test_a_request_cancelled_mid_chunk_frees_its_slot_and_leaves_nothing_in_the_pool(family):
    engine_ = engine(family, exact="gemm", budget=16, cache_mb=16)
    free = len(engine_.scheduler.free_slots)
    engine_.add("long", dataclasses.replace(text_job(family, " ".join(TEXTS)), prefix=None))
    engine_.add("kept", text_job(family, " ".join(TEXTS)))
    engine_.step()
    engine_.abort("long")
    engine_.abort("kept")
    assert len(engine_.scheduler.free_slots) == free and not engine_.scheduler.partial and engine_.running == 0
    assert engine_.prefix_pool.blocks == 0 and not engine_._requests
    whole = run(engine(family, exact="gemm"), {"again": text_job(family, " ".join(TEXTS))})["again"]
    assert_same_bits(run(engine_, {"again": text_job(family, " ".join(TEXTS))})["again"], whole, "after the abort")


def test_exact_mode_s_per_row_kernels_prefill_a_long_prompt_whole_in_a_step_of_its_own(family):
    short = text_job(family, "Hi.")
    engine_ = engine(family, exact="on", budget=short.prompt.num_tokens + 1)
    engine_.add("short", short)
    engine_.add("long", text_job(family, " ".join(TEXTS)))
    first = {rid for rid, e in engine_.step() if type(e).__name__.endswith("Prefilled")}
    second = {rid for rid, e in engine_.step() if type(e).__name__.endswith("Prefilled")}
    assert (first, second) == ({"short"}, {"long"})  # whole, never refused: in the next step


def test_a_prompt_that_fails_in_its_prefill_fails_alone_and_the_others_of_the_step_go_on(family, monkeypatch, wav_bytes,
                                                                                      png_bytes):
    """A media part the model refuses only when it runs (here the audio encoder raising on it) ends
    that request with INVALID_ARGUMENT naming the field; the step's other prompts are served."""
    jobs = {f"t{i}": text_job(family, text) for i, text in enumerate(TEXTS[:3])}
    jobs["audio"] = job(family, conversation(1, wav_bytes, png_bytes))
    engine_ = engine(family)
    audio_tower = engine_.model.audio_tower

    def refuse(*args, **kwargs):
        raise ValueError("the audio encoder refused the clip")
    monkeypatch.setattr(audio_tower, "forward", refuse)
    failed, tokens = {}, {rid: [] for rid in jobs}
    for rid, j in jobs.items():
        engine_.add(rid, j)
    while engine_.has_work():
        for rid, event in engine_.step():
            if isinstance(event, RequestFailed):
                failed[rid] = event
            elif isinstance(event, Token):
                tokens[rid].append(event.token_id)
    assert set(failed) == {"audio"} and failed["audio"].field == "messages"
    assert "refused the clip" in failed["audio"].message
    assert all(len(tokens[rid]) == 4 for rid in jobs if rid != "audio") and engine_.running == 0
