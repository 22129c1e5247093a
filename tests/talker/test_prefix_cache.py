"""The talkers' prefix cache (services/talker/engine.py `prefill_from_prefix`, keys from
services/runtime/lm/prefix/ `row_block_keys`), in `--exact-batching gemm`, where hits are used
and exact by construction, engines on the tiny checkpoints (both families), nothing mocked.

Pinned bugs (project issue 48, item 0):
- the usable-block bound `(len(ids) - 1) // BLOCK_TOKENS` of `prefill_from_prefix` written as
  `len(ids) // BLOCK_TOKENS`: a talker prompt re-sent whole (a retry, a "regenerate") whose length
  is a multiple of 16 finds every block and leaves the prefill nothing to compute (it crashes);
- the row keys computed from the ids alone: two Qwen3-Omni talker prompts with the same ids and
  other rows (the same text with another image of the same size) share blocks, and the second's
  audio is silently the first's history's.
"""

from __future__ import annotations

import io
from collections import defaultdict

import pytest
import torch

from services.runtime.inputs.prompt import ChatMessage, Part, PromptBuilder, Role
from services.runtime.lm.prefix.keys import BLOCK_TOKENS
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.qwen3_omni import talker_prompt_len
from services.talker.engine import TalkerEngine, TalkerJob
from services.talker.engine_base import Frame, TalkerDone, TalkerEngineConfig, TextEnd
from services.talker.qwen2_5 import Qwen2_5TalkerEngine, Qwen2_5TalkerJob, ReplyPart
from services.thinker.engine import Prefilled, ThinkerEngine, ThinkerEngineConfig, Token
from services.tools.inprocess import Handoff
from tests.op_audit import OpAudit
from tests.qwen2_5_oracle import load_engine_stages
from tests.talker.pipeline import seeded_job

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

MAX_MODEL_LEN = 256
TALKER_FRAMES = 6
REPETITION_PENALTY = 1.05  # the talker service's default


def engine_config(prefix_cache_mb: int) -> TalkerEngineConfig:
    return TalkerEngineConfig(max_batch_size=2, num_slots=2, max_model_len=MAX_MODEL_LEN, exact_gemm=True,
                              prefix_cache_mb=prefix_cache_mb)


def speak(engine, request_id: str, job, inputs: list) -> tuple[list, list[torch.Tensor]]:
    """One request alone through a talker engine: its codes (each frame's, or each code for
    Qwen2.5-Omni) and the logits of every step."""
    logits: list[torch.Tensor] = []
    after_forward = engine._after_forward

    def recording(request_ids, states, step_logits, *rest, **more):
        logits.extend(row.detach().clone() for row in step_logits)
        return after_forward(request_ids, states, step_logits, *rest, **more)

    engine._after_forward = recording
    try:
        engine.add(request_id, job)
        for payload in inputs:
            engine.add_input(request_id, payload)
        codes, done = [], None
        while engine.has_work():
            for rid, event in engine.step():
                assert rid == request_id
                if isinstance(event, Frame):
                    codes.append(event.codes.tolist())
                elif isinstance(event, TalkerDone):
                    done = event
        assert done is not None and engine.running == 0
        return codes, logits
    finally:
        engine._after_forward = after_forward


def assert_same_bits(got, want, where: str) -> None:
    assert got[0] == want[0], f"{where}: codes"
    assert len(got[1]) == len(want[1]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1])), f"{where}: logits"


# Re-sending a prompt of whole blocks, both families.

@pytest.fixture(scope="module")
def qwen3_talker(tiny_checkpoint):
    return load_stage(tiny_checkpoint, Stage.TALKER)


def qwen3_whole_blocks_job(config, blocks: int = 2) -> tuple[TalkerJob, list]:
    """A Qwen3-Omni talker job whose prompt (every user-turn position, then the 9 assistant ones) is
    `blocks` whole blocks, its inputs seeded (the thinker's outputs stand-ins: the rows are what is cached)."""
    job, inputs = seeded_job(config, blocks * BLOCK_TOKENS - 9 - 2, 3, TALKER_FRAMES + 1, 4, REPETITION_PENALTY)
    assert job.prompt_len == talker_prompt_len(job.prompt_token_ids, config) == blocks * BLOCK_TOKENS
    return job, inputs


@pytest.mark.exactness
@pytest.mark.parametrize("blocks", [2, 3], ids=["hit_of_1_block", "hit_of_2_blocks"])
def test_a_qwen3_talker_prompt_of_whole_blocks_sent_twice_gives_the_same_bits(qwen3_talker, blocks, monkeypatch):
    """Bug pinned: `(len(ids) - 1) // 16` as `len(ids) // 16` in prefill_from_prefix. The hit cuts
    after an odd and an even number of blocks (on AVX512 an odd cut moved 16 rows of the
    shared-expert gate between the vector and the scalar path), and every op of the re-sent
    request's steps is one the construction covers (tests/op_audit.py)."""
    engine = TalkerEngine(qwen3_talker.model, qwen3_talker.config, engine_config=engine_config(8))
    job, inputs = qwen3_whole_blocks_job(qwen3_talker.config, blocks)
    first = speak(engine, "first", job, inputs)
    assert engine.prefix_pool.stats.hit_tokens == 0 and len(first[0]) == TALKER_FRAMES
    with OpAudit().watching(monkeypatch) as audit:
        again = speak(engine, "again", job, inputs)
    audit.assert_clean("the re-sent talker prompt")
    assert_same_bits(again, first, "the re-sent talker prompt")
    # all but the last block, whose last row is computed
    assert engine.prefix_pool.stats.hit_tokens == (blocks - 1) * BLOCK_TOKENS
    assert engine.exact_report.paths()["prefix_hit"] == "used"


@pytest.mark.exactness
@pytest.mark.parametrize("blocks", [2, 3], ids=["hit_of_1_block", "hit_of_2_blocks"])
def test_a_qwen2_5_talker_prompt_of_whole_blocks_sent_twice_gives_the_same_bits(tiny_qwen2_5_checkpoint, blocks,
                                                                                monkeypatch):
    """Bug pinned: `(len(ids) - 1) // 16` as `len(ids) // 16` in prefill_from_prefix (Qwen2.5-Omni's
    talker prompt: the thinker's hidden states of the prompt, then 2 positions)."""
    _, talker, config = load_engine_stages(tiny_qwen2_5_checkpoint)
    engine = Qwen2_5TalkerEngine(talker, config, engine_config=engine_config(8))
    hidden = config.thinker_config.text_config.hidden_size
    gen = torch.Generator().manual_seed(4)
    job = Qwen2_5TalkerJob(torch.randn(blocks * BLOCK_TOKENS - 2, hidden, generator=gen),
                           torch.randn(3, hidden, generator=gen),
                           SamplingConfig(max_new_tokens=TALKER_FRAMES, repetition_penalty=REPETITION_PENALTY),
                           eos_ids=())  # the tiny talker runs to its max tokens
    assert job.prompt_len == blocks * BLOCK_TOKENS
    inputs = [ReplyPart(torch.randn(hidden, generator=gen)) for _ in range(3)] + [TextEnd()]
    first = speak(engine, "first", job, inputs)
    assert engine.prefix_pool.stats.hit_tokens == 0 and len(first[1]) == TALKER_FRAMES
    with OpAudit().watching(monkeypatch) as audit:
        again = speak(engine, "again", job, inputs)
    audit.assert_clean("the re-sent talker prompt")
    assert_same_bits(again, first, "the re-sent talker prompt")
    assert engine.prefix_pool.stats.hit_tokens == (blocks - 1) * BLOCK_TOKENS
    assert engine.exact_report.paths()["prefix_hit"] == "used"


# The same ids with other rows: Qwen3-Omni's talker, the same question with another image.

def another_image(png: bytes) -> bytes:
    """The same size of image with its first pixel changed."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    image.putpixel((0, 0), tuple(255 - v for v in image.getpixel((0, 0))))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def talker_work(thinker: ThinkerEngine, handoff: Handoff, builder: PromptBuilder, messages, request_id: str):
    """The talker job and inputs the thinker makes of `messages` (the servers' own handoff)."""
    job = handoff.thinker_job(builder.build(messages), SamplingConfig(max_new_tokens=4), voice="chelsie")
    thinker.add(request_id, job)
    talker_job, inputs = None, []
    while thinker.has_work():
        for _, event in thinker.step():
            if isinstance(event, Prefilled):
                talker_job = handoff.talker_job(event, job, SamplingConfig(
                    max_new_tokens=TALKER_FRAMES + 1, repetition_penalty=REPETITION_PENALTY), "chelsie")
            elif isinstance(event, Token):
                inputs += handoff.talker_inputs(event)
    assert talker_job is not None and inputs
    return talker_job, inputs


@pytest.mark.exactness
def test_the_same_talker_ids_with_another_image_s_rows_share_no_block(tiny_checkpoint, qwen3_talker, png_bytes):
    """Bug pinned: the talker's row keys computed from the ids alone (row_block_keys). Two requests
    whose talker prompts have the same ids (the same question, an image of the same size) and other
    rows (another image's hidden states): the second must find none of the first's blocks, and its
    audio is its own cold run's."""
    thinker_stage = load_stage(tiny_checkpoint, Stage.THINKER)
    builder = PromptBuilder(tiny_checkpoint, thinker_stage.config)
    handoff = Handoff(builder, thinker_stage.config)
    thinker = ThinkerEngine(thinker_stage.model, thinker_stage.config, engine_config=ThinkerEngineConfig(
        max_batch_size=2, num_slots=2, max_model_len=MAX_MODEL_LEN, exact_gemm=True))
    works = {}
    for name, image in (("first", png_bytes), ("other", another_image(png_bytes))):
        messages = [ChatMessage(Role.USER, (Part(image=image), Part(text="What do you see? Tell me.")))]
        works[name] = talker_work(thinker, handoff, builder, messages, name)
    first, other = works["first"][0], works["other"][0]
    assert first.prompt_token_ids == other.prompt_token_ids, "the same talker ids"
    assert not torch.equal(first.multimodal_hidden, other.multimodal_hidden), "other rows"
    assert first.prompt_len > BLOCK_TOKENS and first.multimodal_positions[0] < BLOCK_TOKENS  # the image in block 0

    cached = TalkerEngine(qwen3_talker.model, qwen3_talker.config, engine_config=engine_config(8))
    cold = TalkerEngine(qwen3_talker.model, qwen3_talker.config, engine_config=engine_config(0))
    heard = defaultdict(dict)
    heard["cached"]["first"] = speak(cached, "first", *works["first"])
    heard["cached"]["other"] = speak(cached, "other", *works["other"])
    heard["cold"]["other"] = speak(cold, "other", *works["other"])
    assert cached.prefix_pool.stats.lookup_tokens > 0 and cached.prefix_pool.stats.hit_tokens == 0, "no block shared"
    assert_same_bits(heard["cached"]["other"], heard["cold"]["other"], "the other image's request")
    # The check has teeth: the same request re-sent does hit.
    again = speak(cached, "again", *works["other"])
    assert cached.prefix_pool.stats.hit_tokens > 0
    assert_same_bits(again, heard["cold"]["other"], "the other image's request re-sent")
