"""The thinker's prefix cache, both families, on two shapes of hit that no conversation test makes:
a prompt re-sent whole (a retry, a "regenerate"), and a hit whose cached blocks end inside an image.

Pinned bugs (project issue 48, item 0):
- the usable-block bound `(n - 1) // BLOCK_TOKENS` of ThinkerEngine._prefill_forward written as
  `n // BLOCK_TOKENS`: a re-sent prompt whose length is a multiple of 16 then finds every one of
  its blocks, and the prefill is left no position to compute (it crashes);
- the cut of Qwen3-Omni's deepstack visual embeds one row off (`skipping_prefix` in
  services/runtime/lm/prefix/): a hit that ends inside an image's placeholder run hands the
  decoder stack one visual row more or fewer than the visual positions it runs (it crashes).

Both in `--exact-batching gemm`, where hits are used and exact by construction: the hit's output
must equal the cold prefill's (or the first send's) bit for bit.
"""

from __future__ import annotations

import pytest

from omni.v1 import omni_pb2
from services.base.families import family_of
from services.runtime.inputs.prompt import PromptBuilder
from services.runtime.lm.prefix.keys import BLOCK_TOKENS
from services.runtime.model.checkpoint import Stage, load_stage
from services.thinker.admission import messages_from_proto
from services.thinker.server import ADAPTERS
from tests.thinker.conftest import Family_
from tests.thinker.test_prefix_conversation import assert_hits_used, assert_same_bits, job, make_engine, run

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_torch_thread")]


def load_family(checkpoint) -> Family_:
    thinker = load_stage(str(checkpoint), Stage.THINKER)
    builder = PromptBuilder(str(checkpoint), thinker.config)
    adapter = ADAPTERS[family_of(str(checkpoint))](str(checkpoint), thinker.config, builder)
    return Family_(str(checkpoint), thinker, builder, adapter, builder.tokenizer.convert_tokens_to_ids("<|im_start|>"))


@pytest.fixture(scope="module", params=["qwen3", "qwen2_5"])
def family(request) -> Family_:
    return load_family(request.getfixturevalue("tiny_checkpoint" if request.param == "qwen3"
                                               else "tiny_qwen2_5_checkpoint"))


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint) -> Family_:
    return load_family(tiny_checkpoint)


def request_of(user: list[omni_pb2.Content], system: str = "You are a helpful voice assistant.") -> omni_pb2.GenerateRequest:
    request = omni_pb2.GenerateRequest()
    request.messages.add(role=omni_pb2.ROLE_SYSTEM).content.add(text=system)
    request.messages.add(role=omni_pb2.ROLE_USER).content.extend(user)
    return request


def prompt_tokens(family: Family_, request: omni_pb2.GenerateRequest) -> int:
    return family.builder.build(messages_from_proto(request)).num_tokens


def whole_blocks_request(family: Family_) -> omni_pb2.GenerateRequest:
    """A text request whose prompt is a whole number of blocks (found by lengthening its text)."""
    for extra in range(BLOCK_TOKENS):
        for mark in range(BLOCK_TOKENS):
            request = request_of([omni_pb2.Content(text="Say that again, please" + " again" * extra + "!" * mark)])
            if prompt_tokens(family, request) % BLOCK_TOKENS == 0:
                return request
    raise AssertionError("no text length gave a prompt of whole blocks")


@pytest.mark.exactness
def test_a_prompt_of_whole_blocks_sent_twice_gives_the_same_bits_from_all_but_its_last_block(family):
    """Bug pinned: `(n - 1) // 16` as `n // 16` in ThinkerEngine._prefill_forward (a re-sent prompt
    of 16k tokens found all k blocks and left the prefill nothing to compute)."""
    request = whole_blocks_request(family)
    tokens = prompt_tokens(family, request)
    assert tokens % BLOCK_TOKENS == 0 and tokens >= 2 * BLOCK_TOKENS
    engine = make_engine(family, "gemm", cache_mb=16)
    first = run(engine, {"first": job(family, request)})["first"]
    assert engine.prefix_pool.stats.hit_tokens == 0
    again = run(engine, {"again": job(family, request)})["again"]
    assert_same_bits(again, first, "the re-sent prompt")
    # Every block but the last came from the cache: its last position is always computed.
    assert engine.prefix_pool.stats.hit_tokens == tokens - BLOCK_TOKENS
    assert_hits_used(engine, used=True)
    assert engine.running == 0 and not engine.has_work()


def image_runs(family: Family_, request: omni_pb2.GenerateRequest) -> tuple[int, int]:
    """[start, end) of the image's placeholder tokens in the request's prompt."""
    ids = family.builder.build(messages_from_proto(request)).input_ids[0]
    image = (ids == family.thinker.config.thinker_config.image_token_id).nonzero().flatten().tolist()
    assert image and image == list(range(image[0], image[-1] + 1)), "one run of image tokens"
    return image[0], image[-1] + 1


def mid_image_pair(family: Family_, png: bytes) -> tuple[omni_pb2.GenerateRequest, omni_pb2.GenerateRequest, int]:
    """Two requests with the same system prompt and image, their questions after the image different
    from the first token on (the user edited the question), the system prompt's length chosen so
    that the block boundary before their first difference falls inside the image's placeholder run:
    the second request's hit ends mid-image. Returns them and the hit's tokens."""
    for pad in range(2 * BLOCK_TOKENS):
        system = "You are a helpful voice assistant." + " Be brief." * pad
        first = request_of([omni_pb2.Content(image=png), omni_pb2.Content(text="What is in this picture?")], system)
        second = request_of([omni_pb2.Content(image=png), omni_pb2.Content(text="Which colours do you see?")], system)
        a = family.builder.build(messages_from_proto(first)).input_ids[0].tolist()
        b = family.builder.build(messages_from_proto(second)).input_ids[0].tolist()
        differ = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        hit = differ // BLOCK_TOKENS * BLOCK_TOKENS
        start, end = image_runs(family, first)
        if start + 1 < hit < end - 1:  # at least two image rows on either side of the cut
            return first, second, hit
    raise AssertionError("no system prompt length put a block boundary inside the image")


@pytest.mark.exactness
def test_a_hit_that_ends_inside_an_image_gives_the_cold_prefill_s_bits(qwen3, png_bytes):
    """Bug pinned: Qwen3-Omni's deepstack visual embeds cut one row off at the hit (`before` in
    prefix_cache.skipping_prefix): the decoder stack's visual rows no longer match its visual
    positions. The same image with an edited question: the hit ends inside the image."""
    first, second, hit_tokens = mid_image_pair(qwen3, png_bytes)
    cached, cold = make_engine(qwen3, "gemm", cache_mb=16), make_engine(qwen3, "gemm", cache_mb=0)
    run(cached, {"first": job(qwen3, first)})
    before = cached.prefix_pool.stats.hit_tokens
    got = run(cached, {"second": job(qwen3, second)})["second"]
    want = run(cold, {"second": job(qwen3, second)})["second"]
    assert cached.prefix_pool.stats.hit_tokens - before == hit_tokens, "the hit ends where the two prompts part, mid-image"
    assert_same_bits(got, want, "the edited question after the same image")
    assert_hits_used(cached, used=True)

