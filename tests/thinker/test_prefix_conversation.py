"""The thinker's prefix cache over a conversation, both families: turn N prefilled from the blocks of
turns 1..N-1 gives the bits of turn N prefilled cold, and transformers' `generate` on the whole history.

An 8-turn conversation (system prompt; an audio clip in the first user turn, an image in the
second; earlier replies re-sent as assistant turns) goes through one engine with the cache and
one without, turn by turn, each turn a talker-fed request: every generated id, the logits it was
picked from, and the `Prefilled` hidden states the talker is started from must be bit-identical
(the talker's frames are a function of those), and the ids must equal `generate`'s on the whole
history. `--exact-batching gemm` (generate through the same invariant GEMM and attention is the
oracle) uses hits, exact by construction; per-row exact mode (plain generate) refuses them, which
its run asserts along with the same bits. Then 8 such conversations at once, their turns batched
together, against each turn alone.
"""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch

from omni.v1 import omni_pb2
from services.base.families import family_of
from services.runtime.lm.sampling import SamplingConfig
from services.thinker.admission import messages_from_proto, prompt_prefix
from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig, Token
from services.thinker.server import ADAPTERS
from services.tools.reference import ReferenceRunner
from tests.thinker.conftest import Family_

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_torch_thread")]

TURNS = 8
MAX_NEW_TOKENS = 5
MAX_MODEL_LEN = 768
REPLIES = ("Sure, here is what I heard in the clip.", "That picture shows a pattern of colored noise.",
           "Yes.", "I would say the second option, for the reasons you gave earlier in our chat.",
           "Tomorrow looks sunny.", "Three apples and two pears.", "Goodbye for now!")
USER_TEXTS = ("What do you hear?", "And what is in this picture?", "Are you sure?",
              "Which of the two would you pick, and why?", "What about the weather?",
              "Count the fruit in my basket.", "Thanks, that is all.", "One last thing: say hello.")


def conversation(turn: int, wav: bytes, png: bytes, salt: str = "") -> omni_pb2.GenerateRequest:
    """Turn `turn` (1-based) of the conversation: the system prompt, `turn` user messages and the
    `turn - 1` replies between them."""
    request = omni_pb2.GenerateRequest()
    request.messages.add(role=omni_pb2.ROLE_SYSTEM).content.add(text=f"You are a helpful voice assistant.{salt}")
    for t in range(turn):
        user = request.messages.add(role=omni_pb2.ROLE_USER)
        if t == 0:
            user.content.add(audio=wav)
        if t == 1:
            user.content.add(image=png)
        user.content.add(text=USER_TEXTS[t] + salt)
        if t < turn - 1:
            request.messages.add(role=omni_pb2.ROLE_ASSISTANT).content.add(text=REPLIES[t])
    return request


def make_engine(family: Family_, mode: str, cache_mb: int) -> ThinkerEngine:
    engine_cls = ADAPTERS[family_of(family.checkpoint)].engine
    config = ThinkerEngineConfig(max_batch_size=8, num_slots=8, max_model_len=MAX_MODEL_LEN, exact_batching=True,
                                 exact_gemm=mode == "gemm", prefix_cache_mb=cache_mb)
    return engine_cls(family.thinker.model, family.thinker.config, engine_config=config)


def job(family: Family_, request: omni_pb2.GenerateRequest, feature_cache=None):
    """`feature_cache`: the prompt's audio features each computed alone and kept there (the thinker
    with its encoder cache on: PromptBuilder.feature_cache)."""
    builder = family.builder
    if feature_cache is not None:
        builder = copy.copy(builder)
        builder.feature_cache = feature_cache
    prompt = builder.build(messages_from_proto(request))
    voice = family.adapter.resolve_voice(None)
    made = family.adapter.job(prompt, SamplingConfig(max_new_tokens=MAX_NEW_TOKENS), True, (), voice)
    return dataclasses.replace(made, prefix=prompt_prefix(request, prompt.input_ids[0], family.im_start))


@dataclasses.dataclass
class Out:
    tokens: list
    logits: list
    prefilled: object = None


def run(engine: ThinkerEngine, jobs: dict) -> dict[str, Out]:
    """Every job added at once, stepped to the end: request id -> its ids, logits and `Prefilled`."""
    outs = {rid: Out([], []) for rid in jobs}
    sample = engine._sample

    def recording(request_id, request, row_logits, *picked):
        outs[request_id].logits.append(row_logits.detach().clone())
        return sample(request_id, request, row_logits, *picked)

    engine._sample = recording
    for rid, j in jobs.items():
        engine.add(rid, j)
    while engine.has_work():
        for rid, event in engine.step():
            if isinstance(event, Token):
                outs[rid].tokens.append(event.token_id)
            elif type(event).__name__.endswith("Prefilled"):
                outs[rid].prefilled = event
    engine._sample = sample
    return outs


def assert_same_bits(cached: Out, cold: Out, where: str) -> None:
    assert cached.tokens == cold.tokens, where
    assert all(torch.equal(a, b) for a, b in zip(cached.logits, cold.logits, strict=True)), where
    for name, value in vars(cold.prefilled).items():
        got = getattr(cached.prefilled, name)
        same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
        assert same, f"{where}: Prefilled.{name}"


def assert_hits_used(engine: ThinkerEngine, used: bool) -> None:
    """Hits used (gemm), or refused (per-row kernels: said once, exported, counted)."""
    stats = engine.prefix_pool.stats
    assert engine.prefix_hits is used, engine.exact_report.reasons.get("prefix_hit")
    assert engine.exact_report.paths()["prefix_hit"] == ("used" if used else "refused")
    if used:
        assert stats.hit_tokens > 0 and stats.refused_tokens == 0
    else:
        assert stats.hit_tokens == 0 and stats.refused_tokens > 0


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["rows", "gemm"])
def test_each_turn_from_cached_blocks_equals_the_cold_prefill_and_generate(family, mode, wav_bytes, png_bytes):
    cached, cold = make_engine(family, mode, cache_mb=16), make_engine(family, mode, cache_mb=0)
    reference = ReferenceRunner(family.checkpoint, gemm=mode == "gemm")
    for turn in range(1, TURNS + 1):
        request = conversation(turn, wav_bytes, png_bytes)
        got = run(cached, {"turn": job(family, request)})["turn"]
        want = run(cold, {"turn": job(family, request)})["turn"]
        assert_same_bits(got, want, f"turn {turn}")
        oracle = reference.generate(messages_from_proto(request), max_new_tokens=MAX_NEW_TOKENS, return_audio=False)
        assert got.tokens == oracle.thinker_token_ids, f"turn {turn}"
    assert_hits_used(cached, used=mode == "gemm")
    # The index names what is held; refusing hits, the engine holds nothing for the router to route to.
    assert cached.running == 0 and bool(cached.prefix_pool.index.report(0, 0)[3]) is (mode == "gemm")


@pytest.mark.exactness
@pytest.mark.slow  # 64 cold runs beside the batched ones, both families: ~10 s of make test's 2 cores
def test_eight_conversations_at_once_equal_each_turn_alone(family, wav_bytes, png_bytes):
    """8 conversations, each turn of all 8 added together (prefilled one a step beside the others'
    decoding), from the cache (gemm mode: hits by construction of every linear layer), against each
    request alone in a cold engine."""
    cached, cold = make_engine(family, "gemm", cache_mb=16), make_engine(family, "gemm", cache_mb=0)
    for turn in range(1, TURNS + 1):
        requests = {f"c{c}": conversation(turn, wav_bytes, png_bytes, salt=" " + "!" * c) for c in range(8)}
        together = run(cached, {rid: job(family, r) for rid, r in requests.items()})
        for rid, request in requests.items():
            alone = run(cold, {rid: job(family, request)})[rid]
            assert_same_bits(together[rid], alone, f"turn {turn} {rid}")
    assert_hits_used(cached, used=True)


def another_image(png: bytes) -> bytes:
    """The same size of image with its first pixel changed."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    image.putpixel((0, 0), tuple(255 - v for v in image.getpixel((0, 0))))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_another_image_under_the_same_text_is_a_miss(family, wav_bytes, png_bytes):
    engine = make_engine(family, "gemm", cache_mb=16)
    first = conversation(2, wav_bytes, png_bytes)
    run(engine, {"a": job(family, first)})
    image_at = job(family, first).prefix.starts[3]  # the second user turn, which holds the image
    other_png = another_image(png_bytes)
    stats = engine.prefix_pool.stats
    before = stats.hit_tokens + stats.refused_tokens
    run(engine, {"b": job(family, conversation(2, wav_bytes, other_png))})
    found = stats.hit_tokens + stats.refused_tokens - before
    assert 0 < found <= image_at, "only the blocks before the image's message are shared"


def test_a_template_that_renders_other_turns_is_not_cached(family, wav_bytes, png_bytes):
    request = conversation(1, wav_bytes, png_bytes)
    prompt = family.builder.build(messages_from_proto(request))
    assert prompt_prefix(request, prompt.input_ids[0], family.im_start) is not None
    request.messages.add(role=omni_pb2.ROLE_USER).content.add(text="x")  # a message the prompt does not hold
    assert prompt_prefix(request, prompt.input_ids[0], family.im_start) is None
