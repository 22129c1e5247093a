"""Qwen2_5ThinkerEngine + Qwen2_5TalkerEngine in-process, against transformers' generate.

The harness does what the two servers do, without gRPC: a `Qwen2_5Prefilled` event starts the
talker request; every `Token` with a reply part hands it over as a `ReplyPart`; the last token
also hands over `TextEnd`. Sixteen requests of every modality and both voices join at different
steps, on the tiny checkpoint and on one of other sizes (tests/conftest.py); every one's text ids
and codec ids must equal `Qwen2_5OmniForConditionalGeneration.generate`'s (greedy, talker
repetition penalty 1.05, the real codec end ids 8292 and 8294, the talker running to its max
tokens: the tiny checkpoints' codec head rows from 8192 up, those ids among them, are zero).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from omni.v1 import omni_pb2, stages_pb2
from services.base.finish import FinishReason
from services.runtime.inputs.prompt import ChatMessage, Part, PromptBuilder, Role
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import voice_bos_tokens
from services.runtime.model.qwen2_5_omni import resolve_voice
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from services.talker.config import TalkerConfig
from services.talker.engine_base import Frame, TalkerDone, TalkerEngineConfig, TextEnd
from services.talker.qwen2_5 import Qwen2_5TalkerEngine, Qwen2_5TalkerJob, ReplyPart
from services.talker.qwen2_5_adapter import qwen2_5_input_from_proto, qwen2_5_job_from_proto
from services.thinker.engine import Finished, ThinkerEngineConfig, Token
from services.thinker.qwen2_5 import Qwen2_5Prefilled, Qwen2_5ThinkerEngine, Qwen2_5ThinkerJob
from services.thinker.qwen2_5_adapter import qwen2_5_talker_start, qwen2_5_text_tokens
from services.tools.reference import ReferenceRunner
from tests.qwen2_5_oracle import BY_ID, CASES, TALKER_EOS_IDS, Case, case_messages, generate_reference, load_engine_stages, media
from tests.talker.pipeline import TwoStagePipeline, assert_clean

SLOTS = 16
MAX_MODEL_LEN = 256  # prompts < 130 tokens; + 2 + 24 talker tokens
REPETITION_PENALTY = 1.05  # generate's talker default


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/thinker/test_qwen2_5_engine.py


class Setup:
    def __init__(self, folder, gemm: bool = False, references: bool = True):
        """`gemm`: the reference runs generate through the invariant GEMM and attention (the
        oracle of --exact-batching gemm); `references`: generate's results for CASES, made now."""
        self.runner = ReferenceRunner(folder, gemm=gemm)
        self.thinker, self.talker, self.config = load_engine_stages(folder)
        self.builder = PromptBuilder(folder, self.config)
        self.voices = voice_bos_tokens(folder)
        files = media()
        self.messages = {c.request_id: case_messages(c, files) for c in CASES}
        self.expected = {c.request_id: self.reference(c) for c in CASES} if references else {}

    def reference(self, case, eos_ids=TALKER_EOS_IDS):
        return generate_reference(self.runner, self.messages[case.request_id], case.voice, case.max_new_tokens,
                                  case.talker_max_new_tokens, eos_ids)


# The wide checkpoint's runs (14 s of the two cores) in make test-slow (CI); the tiny one's here.
@pytest.fixture(scope="module", params=["tiny", pytest.param("wide", marks=pytest.mark.slow)])
def setup(request) -> Setup:
    fixture = {"tiny": "tiny_qwen2_5_checkpoint", "wide": "tiny_qwen2_5_checkpoint_wide"}[request.param]
    return Setup(request.getfixturevalue(fixture))


@pytest.fixture(scope="module")
def tiny(tiny_qwen2_5_checkpoint) -> Setup:
    return Setup(tiny_qwen2_5_checkpoint)


class Pipeline(TwoStagePipeline):
    """The two Qwen2.5-Omni engines stepped in turn (tests/talker/pipeline.py), the thinker's outputs
    handed over in-process: a reply part per token, TextEnd after the last."""

    def __init__(self, setup: Setup, slots: int = SLOTS, text_every: dict | None = None,
                 eos_ids: tuple[int, ...] = TALKER_EOS_IDS, wire: bool = False, gemm: bool = False,
                 talker_prefix_cache_mb: int = 0, device_sampling: bool | None = None):
        config = setup.config
        super().__init__(
            Qwen2_5ThinkerEngine(setup.thinker, config, engine_config=ThinkerEngineConfig(
                max_batch_size=slots, num_slots=slots, max_model_len=MAX_MODEL_LEN, exact_gemm=gemm,
                device_sampling=device_sampling)),
            Qwen2_5TalkerEngine(setup.talker, config, engine_config=TalkerEngineConfig(
                max_batch_size=slots, num_slots=slots, max_model_len=MAX_MODEL_LEN, exact_gemm=gemm,
                prefix_cache_mb=talker_prefix_cache_mb, device_sampling=device_sampling)),
            text_every)
        self.messages: dict[str, list] = {}  # request_id -> its messages, where not setup.messages
        self.setup = setup
        self.wire = wire  # hand everything over as the servers do: protos, serialized and parsed back
        self.previous_id: dict[str, int] = {}  # request_id -> the last text id (wire: its TextToken comes next)
        self.eos_ids = eos_ids
        self.cases: dict = {}
        self.tokens: dict[str, list[int]] = defaultdict(list)  # request_id -> text ids
        self.codes: dict[str, list[int]] = defaultdict(list)  # request_id -> codec ids of its frames
        self.finished: dict[str, Finished] = {}
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)  # request_id -> talker logits per step
        self.steps = 0
        after_forward = self.talker._after_forward

        def recording(request_ids, states, logits):
            for rid, row in zip(request_ids, logits):
                self.logits[rid].append(row.detach().cpu().clone())
            return after_forward(request_ids, states, logits)

        self.talker._after_forward = recording

    def add(self, case) -> None:
        self.cases[case.request_id] = case
        _, bos = resolve_voice(self.setup.voices, case.voice)
        prompt = self.setup.builder.build(self.messages.get(case.request_id) or self.setup.messages[case.request_id])
        self.thinker.add(case.request_id, Qwen2_5ThinkerJob(
            prompt, SamplingConfig(max_new_tokens=case.max_new_tokens), True, voice_bos_token=bos))

    def on_thinker_event(self, rid: str, event) -> None:
        if isinstance(event, Qwen2_5Prefilled):
            sampling = SamplingConfig(max_new_tokens=self.cases[rid].talker_max_new_tokens,
                                      repetition_penalty=REPETITION_PENALTY)
            job = Qwen2_5TalkerJob(event.prompt_hidden, event.text_embeds, sampling, self.eos_ids)
            if self.wire:
                job = replace(self.start_over_the_wire(rid, event), eos_ids=self.eos_ids)
                assert job.sampling == sampling
            self.talker.add(rid, job)
        elif isinstance(event, Token):
            self.tokens[rid].append(event.token_id)
            if self.wire:
                hidden = self.setup.config.thinker_config.text_config.hidden_size
                for message in qwen2_5_text_tokens(event, self.previous_id.get(rid)):
                    message = stages_pb2.TalkerInput.FromString(message.SerializeToString())
                    if message.HasField("token"):
                        assert message.token.token_id == self.tokens[rid][-2]  # the token the reply part is of
                    self.inbox[rid].append(qwen2_5_input_from_proto(message, hidden))
                self.previous_id[rid] = event.token_id
                return
            if event.reply is not None:
                self.inbox[rid].append(ReplyPart(event.reply))
            if event.last:
                self.inbox[rid].append(TextEnd())
        elif isinstance(event, Finished):
            self.finished[rid] = event

    def start_over_the_wire(self, rid: str, event: Qwen2_5Prefilled) -> Qwen2_5TalkerJob:
        case = self.cases[rid]
        request = omni_pb2.GenerateRequest(request_id=rid, voice=case.voice)
        request.talker_sampling.max_new_tokens = case.talker_max_new_tokens
        start = qwen2_5_talker_start(request, stages_pb2.Route(talker="t:1", code2wav="c:1"), event)
        start = stages_pb2.TalkerStart.FromString(start.SerializeToString())
        assert not start.HasField("prompt_embeds") and not start.HasField("tts_embeds")  # Qwen3-Omni's fields
        config = TalkerConfig(serving=ServingConfig(), model=ModelConfig(checkpoint="unused"),
                              engine=TalkerEngineConfig(max_model_len=MAX_MODEL_LEN))
        return qwen2_5_job_from_proto(start, self.setup.config, config)

    def on_frame(self, rid: str, event: Frame) -> None:
        assert event.index == len(self.codes[rid]) and event.codes.shape == (1,)
        self.codes[rid].append(int(event.codes[0]))

    def run(self, cases, max_steps: int = 400) -> Pipeline:
        return self.drive(cases, self.add, max_steps)


def assert_equals_reference(pipe: Pipeline, request_ids, expected: dict | None = None) -> None:
    expected = expected or pipe.setup.expected
    for rid in request_ids:
        want = expected[rid]
        assert pipe.tokens[rid] == want.token_ids, f"{rid}: text ids"
        ends = [i for i, c in enumerate(want.codes) if c in pipe.eos_ids]
        frames = want.codes[:ends[0]] if ends else want.codes  # generate cuts the codes at the first end id
        ended = bool(ends)
        assert pipe.codes[rid] == frames, f"{rid}: codec ids"
        done = pipe.done[rid]
        assert done.frames == len(frames)
        assert done.reason is (FinishReason.STOP if ended else FinishReason.LENGTH), rid


@pytest.mark.exactness
def test_sixteen_concurrent_requests_equal_generate(setup):
    pipe = Pipeline(setup).run(CASES)
    assert_equals_reference(pipe, [c.request_id for c in CASES])
    for case in CASES:  # the talker ran to its max tokens: long codec sequences
        assert len(pipe.codes[case.request_id]) == case.talker_max_new_tokens
    assert_clean(pipe)
    per_step = defaultdict(int)  # they really overlapped in the talker's steps
    for steps in pipe.frame_steps.values():
        for s in steps:
            per_step[s] += 1
    assert max(per_step.values()) >= 10


@pytest.fixture(scope="module")
def alone(tiny) -> dict:
    """request_id -> Pipeline of that request alone (tiny checkpoint)."""
    return {case.request_id: Pipeline(tiny, slots=1).run([replace(case, join_step=0)]) for case in CASES}


@pytest.mark.slow  # 5 s; the in-process concurrency test keeps Qwen2.5 in make test: make test-slow (CI)
@pytest.mark.exactness
def test_sixteen_concurrent_requests_through_the_wire_messages_equal_generate(tiny):
    # The stage-to-stage contract: TalkerStart fields 13-14 and TextToken.reply, serialized and
    # parsed back, converted by the adapters' functions, give the engines exactly generate's codes.
    pipe = Pipeline(tiny, wire=True).run(CASES)
    assert_equals_reference(pipe, [c.request_id for c in CASES])
    assert_clean(pipe)


@pytest.mark.exactness
def test_each_request_alone_equals_generate(alone):
    for case in CASES:
        assert_equals_reference(alone[case.request_id], [case.request_id])
        assert_clean(alone[case.request_id])


@pytest.mark.exactness
def test_batched_talker_logits_are_bit_identical_to_alone(tiny, alone):
    # Batch invariance, beyond the argmax: every talker step's logits in the 16-request batch are
    # the ones the request gets alone (exact batching; with plain batched GEMMs they differ).
    pipe = Pipeline(tiny).run(CASES)
    for case in CASES:
        rid = case.request_id
        mine, solo = pipe.logits[rid], alone[rid].logits[rid]
        assert len(mine) == len(solo) == case.talker_max_new_tokens
        diffs = [float((a - b).abs().max()) for a, b in zip(mine, solo)]
        assert diffs == [0.0] * len(diffs), f"{rid}: max |logit difference| per step {diffs}"


def test_generate_feeds_its_talker_no_attention_mask(tiny):
    # Why the talker's positions are plain and no codec bos/pad embedding is added: generate drops
    # the all-ones mask, and the talker's forward does both only when it gets one. If a transformers
    # update changes this, this test names the cause before the exactness tests fail.
    seen = []  # (attention_mask, position_ids) of every talker forward inside generate
    hook = tiny.runner.model.talker.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs.get("attention_mask"), kwargs.get("position_ids"))),
        with_kwargs=True)
    try:
        tiny.reference(BY_ID["image-ethan"])
    finally:
        hook.remove()
    assert len(seen) == BY_ID["image-ethan"].talker_max_new_tokens
    assert all(mask is None and positions is None for mask, positions in seen)


@pytest.fixture(scope="module")
def ending(tmp_path_factory) -> Setup:
    """`omni-tiny-checkpoint --family qwen2_5_omni --eos`: the thinker's <|im_end|> and the talker's
    codec end (8294) win after a few steps, so requests end on the real end ids."""
    from services.tools.tiny_qwen2_5_omni import build

    return Setup(build(tmp_path_factory.mktemp("eos25") / "eos", seed=0, eos=True))


@pytest.mark.exactness
def test_requests_end_on_the_real_end_ids_as_generate_ends_them(ending):
    pipe = Pipeline(ending).run(CASES)
    assert_equals_reference(pipe, [c.request_id for c in CASES])
    assert_clean(pipe)
    text_stops = [rid for rid, f in pipe.finished.items() if f.reason is FinishReason.STOP]
    talker_stops = [rid for rid, d in pipe.done.items() if d.reason is FinishReason.STOP]
    # Measured: 13 of the 16 end on <|im_end|> and 13 on the codec end (one with no frame at all).
    assert len(text_stops) >= 8 and len(talker_stops) >= 8, (text_stops, talker_stops)
    for rid in text_stops:
        assert pipe.tokens[rid][-1] == ending.config.thinker_config.eos_token_id


@pytest.mark.exactness
def test_the_device_samplers_equal_generate(ending):
    # The cuda default (services/runtime/lm/device_sampling.py) on CPU tensors: text ids and codes drawn
    # in one batched pass a step (the talker's penalty from each slot's seen mask, its start codes
    # included), copied back once; generate's ids, its end ids ending requests as there.
    pipe = Pipeline(ending, device_sampling=True).run(CASES)
    assert pipe.talker.sampler is not None and pipe.thinker.sampler is not None
    assert_equals_reference(pipe, [c.request_id for c in CASES])
    assert_clean(pipe)
    assert any(d.reason is FinishReason.STOP for d in pipe.done.values())


@pytest.mark.exactness
def test_the_talker_end_id_ends_the_request_as_generate_cuts_it(tiny):
    # The tiny talker never emits its end ids; take a code it does emit as the end id instead, for
    # generate and the engine alike: both must stop at its first occurrence, without that frame.
    case = BY_ID["text-chelsie"]
    code = tiny.expected[case.request_id].codes[6]
    expected = {case.request_id: tiny.reference(case, eos_ids=(code,))}
    assert len(expected[case.request_id].codes) < case.talker_max_new_tokens
    pipe = Pipeline(tiny, eos_ids=(code,)).run([case])
    assert_equals_reference(pipe, [case.request_id], expected)
    assert pipe.done[case.request_id].reason is FinishReason.STOP
    assert_clean(pipe)


@pytest.mark.exactness
def test_slow_text_waits_without_blocking_another_request(tiny):
    slow, fast = BY_ID["long-text-chelsie"], BY_ID["audio-chelsie"]
    # The slow one's speech outlasts no text: 16 tokens, 8 codes; give it more codes to wait for.
    slow = replace(slow, talker_max_new_tokens=20, join_step=0)
    fast = replace(fast, join_step=0)
    expected = {slow.request_id: tiny.reference(slow), fast.request_id: tiny.expected[fast.request_id]}
    pipe = Pipeline(tiny, text_every={slow.request_id: 3}).run([slow, fast])
    waited, fast_steps = pipe.waited[slow.request_id], pipe.frame_steps[fast.request_id]
    overlap = [s for s in waited if s <= fast_steps[-1]]
    assert len(overlap) >= 5 and set(overlap) <= set(fast_steps)  # the other one kept making frames
    assert not set(waited) & set(pipe.frame_steps[slow.request_id])  # it really sat those steps out
    assert fast_steps == list(range(fast_steps[0], fast_steps[0] + len(fast_steps)))  # never held back
    assert_equals_reference(pipe, [slow.request_id, fast.request_id], expected)
    assert_clean(pipe)


def test_talker_starts_once_reply_part_zero_is_there(tiny):
    case = BY_ID["text-ethan"]
    pipe = Pipeline(tiny)
    pipe.add(case)
    for rid, event in pipe.thinker.step():  # prefill: the prompt payload, token 0 (no reply part yet)
        pipe.on_thinker_event(rid, event)
    assert not pipe.inbox[case.request_id]
    assert pipe.talker.queue_depth == 1 and not pipe.talker.has_work()
    for rid, event in pipe.thinker.step():  # token 1 carries reply part 0
        pipe.on_thinker_event(rid, event)
    pipe.talker.add_input(case.request_id, pipe.inbox[case.request_id].popleft())
    assert pipe.talker.has_work()
    events = pipe.talker.step()  # prefilled: code 0; step 1 needs reply part 1
    assert [type(e) for _, e in events] == [Frame]
    assert int(events[0][1].codes[0]) == tiny.expected[case.request_id].codes[0]
    assert pipe.talker.running == 1 and not pipe.talker.has_work()
    pipe.thinker.abort(case.request_id)
    pipe.talker.abort(case.request_id)
    assert_clean(pipe)


def test_one_token_text_ends_the_talker_request_without_frames(tiny):
    # generate cannot speak a one-token reply (it has no reply part to start the talker from: it
    # raises); the engine ends the request with no frames.
    case = replace(BY_ID["text-ethan"], max_new_tokens=1)
    pipe = Pipeline(tiny).run([case])
    assert len(pipe.tokens[case.request_id]) == 1
    assert pipe.done[case.request_id] == TalkerDone(FinishReason.STOP, 0)
    assert not pipe.codes[case.request_id]
    assert_clean(pipe)


@pytest.mark.exactness
def test_abort_mid_batch_frees_the_talker_slot(tiny):
    keep, drop = BY_ID["text-ethan"], BY_ID["image-ethan"]
    pipe = Pipeline(tiny)
    pipe.add(keep)
    pipe.add(drop)
    while len(pipe.codes[drop.request_id]) < 3:
        pipe.step()
    assert pipe.talker.running == 2
    pipe.abort(drop.request_id)
    assert pipe.talker.running == 1 and len(pipe.talker.scheduler.free_slots) == SLOTS - 1
    pipe.talker.abort(drop.request_id)  # twice: no double free
    assert len(pipe.talker.scheduler.free_slots) == SLOTS - 1
    pipe.talker.add_input(drop.request_id, TextEnd())  # late input for a gone request is dropped
    before = len(pipe.codes[drop.request_id])
    while pipe.busy():
        pipe.step()
    assert len(pipe.codes[drop.request_id]) == before
    assert_equals_reference(pipe, [keep.request_id])
    assert_clean(pipe)


def test_reply_part_after_the_end_is_refused(tiny):
    case = BY_ID["text-ethan"]
    pipe = Pipeline(tiny)
    pipe.cases[case.request_id] = case
    hidden = tiny.config.thinker_config.text_config.hidden_size
    pipe.talker.add(case.request_id, Qwen2_5TalkerJob(torch.zeros(5, hidden), torch.zeros(3, hidden), SamplingConfig()))
    pipe.talker.add_input(case.request_id, TextEnd())
    with pytest.raises(ValueError, match="after the end"):
        pipe.talker.add_input(case.request_id, ReplyPart(torch.zeros(hidden)))
    pipe.talker.abort(case.request_id)
    assert_clean(pipe)


@pytest.mark.exactness
@pytest.mark.slow  # three generate calls through the invariant GEMM beside the engines: make test-slow (CI)
def test_a_conversation_s_turns_from_the_talker_s_prefix_cache_equal_generate_on_the_history(tiny_qwen2_5_checkpoint):
    """Three turns, each re-sending the history (the model's replies included), through the two
    engines with --exact-batching gemm and a talker prefix cache. Qwen2.5-Omni's talker prompt is
    the thinker's hidden states of the whole history, so every turn after the first finds the
    earlier turns' blocks, and its ids and codes are still generate's (through the same invariant
    GEMM and attention) on the whole history. Per-row kernels refuse the hits (a ledger)."""
    setup = Setup(tiny_qwen2_5_checkpoint, gemm=True, references=False)
    pipe = Pipeline(setup, gemm=True, talker_prefix_cache_mb=8)
    history = [ChatMessage(Role.SYSTEM, (Part(text="Be brief."),))]
    for turn, text in enumerate(("Hello there! How are you today?", "Tell me about lighthouses.", "Why?")):
        history.append(ChatMessage(Role.USER, (Part(text=text),)))
        case = Case(f"turn-{turn}", text, "Chelsie", 6, 10, 0)
        pipe.messages[case.request_id] = list(history)
        pipe.run([case], max_steps=pipe.steps + 400)
        want = generate_reference(setup.runner, history, case.voice, case.max_new_tokens, case.talker_max_new_tokens)
        assert_equals_reference(pipe, [case.request_id], {case.request_id: want})
        reply = setup.builder.tokenizer.decode(want.token_ids, skip_special_tokens=True)
        history.append(ChatMessage(Role.ASSISTANT, (Part(text=reply),)))
    stats = pipe.talker.prefix_pool.stats
    assert stats.hit_tokens > 0 and stats.refused_tokens == 0, stats
    assert pipe.talker.exact_report.paths()["prefix_hit"] == "used"
    assert_clean(pipe)
    rows = Qwen2_5TalkerEngine(setup.talker, setup.config, engine_config=TalkerEngineConfig(
        max_model_len=MAX_MODEL_LEN, prefix_cache_mb=8))
    assert not rows.prefix_pool.keeps_tensors and rows.exact_report.paths()["prefix_hit"] == "refused"
