"""Qwen2_5ThinkerEngine against transformers' `Qwen2_5OmniForConditionalGeneration.generate`.

For every request of tests/qwen2_5_oracle.py (text, audio, image, audio + image; both voices;
1 to 16 tokens), alone and 16 at once joining at different steps, on the tiny checkpoint
(`omni-tiny-checkpoint --family qwen2_5_omni`) and on one of other sizes (the same builder with a
layout, tests/conftest.py): the text ids equal generate's, and what the engine hands the talker equals,
bit for bit, what generate hands its talker: the prompt rows and the voice's bos row of the
talker's `inputs_embeds`, reply part 0 (its last row), and `thinker_reply_part` (reply parts 1 to
T - 2, then the text eos and pad embeddings).
"""

from __future__ import annotations

import pytest
import torch

from services.base.finish import FinishReason
from services.runtime.inputs.prompt import PromptBuilder
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import voice_bos_tokens
from services.runtime.model.qwen2_5_omni import resolve_voice
from services.thinker.engine import Finished, ThinkerEngineConfig, Token
from services.thinker.qwen2_5 import Qwen2_5Prefilled, Qwen2_5ThinkerEngine, Qwen2_5ThinkerJob
from services.tools.reference import ReferenceRunner
from tests.qwen2_5_oracle import BY_ID, CASES, case_messages, generate_reference, load_engine_stages, media

SLOTS = 16
MAX_MODEL_LEN = 256  # the longest prompt here is ~120 tokens


# One torch thread: the engine and the oracle share the process, so exactness is unaffected; on
# the shared 2-core box tiny ops are much faster on one (see tests/thinker/test_engine.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Setup:
    """One checkpoint: its oracle results and what the engine needs."""

    def __init__(self, folder):
        self.folder = folder
        runner = ReferenceRunner(folder)
        self.thinker, _, self.config = load_engine_stages(folder)
        self.builder = PromptBuilder(folder, self.config)
        self.voices = voice_bos_tokens(folder)
        files = media()
        self.messages = {c.request_id: case_messages(c, files) for c in CASES}
        self.prompts = {rid: self.builder.build(m) for rid, m in self.messages.items()}
        self.expected = {c.request_id: generate_reference(runner, self.messages[c.request_id], c.voice,
                                                          c.max_new_tokens, c.talker_max_new_tokens) for c in CASES}

    def engine(self, slots: int = SLOTS, device_sampling: bool | None = None) -> Qwen2_5ThinkerEngine:
        return Qwen2_5ThinkerEngine(self.thinker, self.config, engine_config=ThinkerEngineConfig(
            max_batch_size=slots, num_slots=slots, max_model_len=MAX_MODEL_LEN, device_sampling=device_sampling))

    def job(self, case, talker: bool = True) -> Qwen2_5ThinkerJob:
        _, bos = resolve_voice(self.voices, case.voice)
        return Qwen2_5ThinkerJob(self.prompts[case.request_id], SamplingConfig(max_new_tokens=case.max_new_tokens),
                                 talker, voice_bos_token=bos)


# The wide checkpoint's runs (14 s of the two cores) in make test-slow (CI); the tiny one's here.
@pytest.fixture(scope="module", params=["tiny", pytest.param("wide", marks=pytest.mark.slow)])
def setup(request) -> Setup:
    fixture = {"tiny": "tiny_qwen2_5_checkpoint", "wide": "tiny_qwen2_5_checkpoint_wide"}[request.param]
    return Setup(request.getfixturevalue(fixture))


def run(setup: Setup, cases, slots: int = SLOTS, device_sampling: bool | None = None) -> tuple[dict, int]:
    """request_id -> its events in order, and the number of engine steps."""
    engine = setup.engine(slots, device_sampling)
    events: dict[str, list] = {}
    pending = sorted(cases, key=lambda c: c.join_step)
    steps = 0
    while pending or engine.has_work():
        while pending and pending[0].join_step <= steps:
            case = pending.pop(0)
            engine.add(case.request_id, setup.job(case))
        for rid, event in engine.step():
            events.setdefault(rid, []).append(event)
        steps += 1
        assert engine.running <= slots
    assert engine.running == 0 and sorted(engine.scheduler.free_slots) == list(range(slots)) and not engine._requests
    return events, steps


def assert_equals_generate(setup: Setup, rid: str, events: list) -> None:
    want = setup.expected[rid]
    prefilled, tokens, finished = events[0], events[1:-1], events[-1]
    assert isinstance(prefilled, Qwen2_5Prefilled) and isinstance(finished, Finished)
    assert [t.token_id for t in tokens] == want.token_ids, f"{rid}: text ids"
    P, T = want.prompt_tokens, len(want.token_ids)
    assert prefilled.prompt_token_ids == setup.prompts[rid].input_ids[0].tolist()
    # The talker's prompt: every prompt row, the voice's bos row, reply part 0 (carried by token 1).
    embeds = want.talker_inputs_embeds
    assert torch.equal(prefilled.prompt_hidden, embeds[:P]), f"{rid}: prompt rows"
    assert torch.equal(prefilled.text_embeds[0], embeds[P]), f"{rid}: voice bos row"
    replies = [t.reply for t in tokens]
    assert replies[0] is None and all(r is not None for r in replies[1:])
    assert torch.equal(replies[1], embeds[P + 1]), f"{rid}: reply part 0"
    # The talker's stream: reply parts 1..T-2, then the text eos and text pad embeddings.
    stream = want.thinker_reply_part
    assert stream.shape[0] == T
    for k in range(1, T - 1):
        assert torch.equal(replies[k + 1], stream[k - 1]), f"{rid}: reply part {k}"
    assert torch.equal(prefilled.text_embeds[1:], stream[T - 2:]), f"{rid}: text eos and pad"


@pytest.mark.exactness
def test_each_request_alone_equals_generate(setup):
    for case in CASES:
        events, _ = run(setup, [case])
        assert_equals_generate(setup, case.request_id, events[case.request_id])


@pytest.mark.exactness
def test_sixteen_concurrent_requests_equal_generate(setup):
    events, steps = run(setup, CASES)
    for case in CASES:
        assert_equals_generate(setup, case.request_id, events[case.request_id])
    # They shared decode steps: far fewer steps than the tokens one after the other.
    assert steps < sum(c.max_new_tokens for c in CASES) // 3


@pytest.mark.exactness
def test_the_device_sampler_equals_generate(setup):
    # The cuda default (services/runtime/lm/device_sampling.py) on CPU tensors: the tokens drawn in one
    # batched pass and the reply parts copied back with them, once a step.
    events, _ = run(setup, CASES, device_sampling=True)
    for case in CASES:
        assert_equals_generate(setup, case.request_id, events[case.request_id])


def test_events_of_one_request(setup):
    case = BY_ID["both-chelsie"]
    events, _ = run(setup, [case])
    prefilled, tokens, finished = events[case.request_id][0], events[case.request_id][1:-1], events[case.request_id][-1]
    prompt = setup.prompts[case.request_id]
    hidden = setup.config.thinker_config.text_config.hidden_size
    assert prefilled.prompt_hidden.shape == (prompt.num_tokens, hidden)
    assert prefilled.text_embeds.shape == (3, hidden)
    assert [t.index for t in tokens] == list(range(case.max_new_tokens))
    assert [t.last for t in tokens] == [False] * (case.max_new_tokens - 1) + [True]
    assert all(t.embedding is None for t in tokens)  # Qwen3-Omni's talker input, not this family's
    assert all(t.reply.shape == (hidden,) for t in tokens[1:])
    assert (finished.reason, finished.prompt_tokens, finished.generated) == (
        FinishReason.LENGTH, prompt.num_tokens, case.max_new_tokens)


@pytest.mark.exactness
def test_text_only_requests_carry_no_talker_inputs(setup):
    engine = setup.engine(2)
    case, other = BY_ID["text-ethan"], BY_ID["audio-chelsie"]
    engine.add(case.request_id, setup.job(case, talker=False))
    engine.add(other.request_id, setup.job(other))  # batched beside a talker-fed request
    events: dict[str, list] = {}
    while engine.has_work():
        for rid, event in engine.step():
            events.setdefault(rid, []).append(event)
    mine = events[case.request_id]
    assert not any(isinstance(e, Qwen2_5Prefilled) for e in mine)
    assert all(e.reply is None and e.embedding is None for e in mine if isinstance(e, Token))
    assert [e.token_id for e in mine if isinstance(e, Token)] == setup.expected[case.request_id].token_ids
    assert_equals_generate(setup, other.request_id, events[other.request_id])


def test_a_talker_job_without_a_voice_is_refused(setup):
    engine = setup.engine(1)
    case = BY_ID["text-ethan"]
    with pytest.raises(ValueError, match="voice_bos_token"):
        engine.add(case.request_id, Qwen2_5ThinkerJob(setup.prompts[case.request_id], SamplingConfig(), True))
    assert not engine.has_work() and not engine._requests
