"""ThinkerEngine + TalkerEngine driven in-process on the tiny checkpoint, against the reference.

The harness does what the two servers and the router do, without gRPC: step the thinker; a
`Prefilled` event starts the talker request; every `Token` becomes a `TextRow` for the talker
(the last one becomes `TextEnd`); step the talker. The handoff is the servers' own adapters
(services/tools/inprocess.py), so the stage messages are made and read as over the wire.
Requests of different lengths, voices and modalities join at different steps, and every one's
text ids and codec frames must equal `ReferenceRunner` (transformers' own generate, greedy).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.base.finish import FinishReason
from services.runtime.inputs.prompt import ChatMessage, Part, PromptBuilder, Role
from services.runtime.lm.kernels import KernelPath
from services.runtime.lm.prefix.keys import PromptPrefix
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.qwen3_omni import talker_prompt_len
from services.talker.engine import TalkerEngine, TalkerJob, TextRow
from services.talker.engine_base import Frame, TalkerDone, TalkerEngineConfig, TextEnd
from services.thinker.engine import (
    Finished,
    Prefilled,
    ThinkerEngine,
    ThinkerEngineConfig,
    ThinkerJob,
    Token,
)
from services.tools.inprocess import Handoff
from services.tools.reference import ReferenceRunner, messages_from_args
from tests.talker.pipeline import TwoStagePipeline, assert_clean

# transformers warns on every talker generate that the penalty skips the prompt; expected here.
pytestmark = [pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
              pytest.mark.usefixtures("one_torch_thread")]

SLOTS = 8
MAX_MODEL_LEN = 128  # prompts here are < 60 tokens; + 16 text tokens or 9 + 16 talker tokens
TALKER_REPETITION_PENALTY = 1.05  # the talker service's default, and generate's


@dataclass(frozen=True)
class Case:
    request_id: str
    prompt: str
    voice: str
    audio: bool
    image: bool
    max_new_tokens: int  # thinker
    talker_max_new_tokens: int  # frames: one fewer
    join_step: int
    system: str | None = None


# 8 requests, every voice and modality, joining at steps 0..12. Some texts outlast their speech
# (16 text tokens, 10 talker tokens) and some speech outlasts its text (6 tokens, then tts_eos and
# tts_pad rows).
CASES = [
    Case("text-ethan", "Hello there!", "ethan", False, False, 6, 12, 0),
    Case("audio-chelsie", "What do you hear?", "chelsie", True, False, 8, 10, 0),
    Case("image-aiden", "Describe the picture.", "aiden", False, True, 10, 14, 2),
    Case("text-chelsie", "Tell me a long story about a lighthouse keeper and a gull.", "chelsie", False, False,
         12, 16, 3),
    Case("both-ethan", "Look and listen.", "ethan", True, True, 7, 11, 5),
    Case("system-aiden", "Hi", "aiden", False, False, 16, 10, 6, system="You are terse."),
    Case("audio-ethan", "Transcribe it.", "ethan", True, False, 9, 13, 9),
    Case("image-chelsie", "Colours?", "chelsie", False, True, 6, 12, 12),
]
BY_ID = {c.request_id: c for c in CASES}


@dataclass(frozen=True)
class Expected:
    token_ids: list[int]
    frames: list[list[int]]  # [frames][num_code_groups]


@pytest.fixture(scope="module")
def stages(tiny_checkpoint):
    return load_stage(tiny_checkpoint, Stage.THINKER), load_stage(tiny_checkpoint, Stage.TALKER)


@pytest.fixture(scope="module")
def messages(wav_file, png_file) -> dict:
    """request_id -> chat messages."""
    return {c.request_id: messages_from_args(c.prompt, c.system, wav_file if c.audio else None,
                                             png_file if c.image else None) for c in CASES}


@pytest.fixture(scope="module")
def builder(tiny_checkpoint, stages):
    return PromptBuilder(tiny_checkpoint, stages[0].config)


def reference_results(checkpoint, cases, messages, gemm: bool = False) -> dict:
    """request_id -> what transformers' generate produces for each case (`gemm`: generate through
    the invariant GEMM, the oracle of `--exact-batching gemm`)."""
    runner = ReferenceRunner(checkpoint, gemm=gemm)
    out = {}
    for c in cases:
        result = runner.generate(messages[c.request_id], voice=c.voice, max_new_tokens=c.max_new_tokens,
                                 talker_max_new_tokens=c.talker_max_new_tokens)
        out[c.request_id] = Expected(result.thinker_token_ids, result.codec_frames)
    return out


@pytest.fixture(scope="module")
def expected(tiny_checkpoint, messages) -> dict:
    """request_id -> generate's output (the slow part of this module: ~1.5 s each)."""
    return reference_results(tiny_checkpoint, CASES, messages)


class Pipeline(TwoStagePipeline):
    """Thinker and talker engines stepped in turn (tests/talker/pipeline.py), text handed over
    in-process through the servers' adapters: a TextRow per token, TextEnd for the last."""

    def __init__(self, stages, builder, exact: bool = True, slots: int = SLOTS, text_every: dict | None = None,
                 gemm: bool = False, prefix_cache_mb: int = 0, device_sampling: bool | None = None,
                 sampling: tuple[SamplingConfig, SamplingConfig] | dict | None = None):
        thinker, talker = stages
        engine = dict(max_batch_size=slots, num_slots=slots, max_model_len=MAX_MODEL_LEN, exact_batching=exact,
                      exact_gemm=gemm, prefix_cache_mb=prefix_cache_mb, device_sampling=device_sampling)
        super().__init__(
            ThinkerEngine(thinker.model, thinker.config, engine_config=ThinkerEngineConfig(**engine)),
            TalkerEngine(talker.model, talker.config, engine_config=TalkerEngineConfig(**engine)),
            text_every)
        self.config = thinker.config
        self.builder = builder
        self.handoff = Handoff(builder, thinker.config)  # the servers' adapters, in-process
        self.cases: dict[str, Case] = {}
        self.jobs: dict = {}  # request_id -> ThinkerJob
        self.tokens: dict[str, list[int]] = defaultdict(list)  # request_id -> text ids
        self.frames: dict[str, list[list[int]]] = defaultdict(list)  # request_id -> codec frames
        self.finished: dict[str, Finished] = {}  # request_id -> the thinker's end
        # The thinker's and the talker's sampling (max_new_tokens: each case's), or request_id -> them;
        # None: greedy, the talker with generate's repetition penalty.
        self.sampling = sampling or (SamplingConfig(), SamplingConfig(repetition_penalty=TALKER_REPETITION_PENALTY))

    def add(self, case: Case, messages) -> None:
        self.cases[case.request_id] = case
        prompt = self.builder.build(messages)
        prefix = None
        if self.thinker.prefix_pool is not None:  # where each message starts (the thinker server's prompt_prefix)
            starts = (prompt.input_ids[0] == self.config.im_start_token_id).nonzero().flatten().tolist()
            prefix = PromptPrefix(tuple(starts), (None,) * len(messages), tuple(bytes([i]) * 16 for i in range(len(messages))))
        sampling = replace(self.sampling_of(case)[0], max_new_tokens=case.max_new_tokens)
        self.jobs[case.request_id] = job = ThinkerJob(prompt, sampling, True, prefix=prefix)
        self.thinker.add(case.request_id, job)

    def sampling_of(self, case: Case) -> tuple[SamplingConfig, SamplingConfig]:
        return self.sampling[case.request_id] if isinstance(self.sampling, dict) else self.sampling

    def on_frame(self, rid: str, event: Frame) -> None:
        assert event.index == len(self.frames[rid])
        self.frames[rid].append(event.codes.tolist())

    def on_thinker_event(self, rid: str, event) -> None:
        case = self.cases[rid]
        if isinstance(event, Prefilled):
            self.talker.add(rid, self.handoff.talker_job(
                event, self.jobs[rid], replace(self.sampling_of(case)[1], max_new_tokens=case.talker_max_new_tokens), case.voice))
        elif isinstance(event, Token):
            self.tokens[rid].append(event.token_id)
            self.inbox[rid] += self.handoff.talker_inputs(event)
        elif isinstance(event, Finished):
            self.finished[rid] = event

    def run(self, cases, messages, max_steps: int = 400) -> Pipeline:
        return self.drive(cases, lambda case: self.add(case, messages[case.request_id]), max_steps)


def assert_equals_reference(pipe: Pipeline, expected: dict, request_ids) -> None:
    for rid in request_ids:
        case, want = pipe.cases[rid], expected[rid]
        assert pipe.tokens[rid] == want.token_ids, f"{rid}: text ids"
        assert len(pipe.frames[rid]) == len(want.frames) == case.talker_max_new_tokens - 1, rid
        for i, (got, ref) in enumerate(zip(pipe.frames[rid], want.frames)):
            assert got == ref, f"{rid}: frame {i} of {len(want.frames)}"
        finished, done = pipe.finished[rid], pipe.done[rid]
        assert finished.generated == case.max_new_tokens
        assert done.reason is FinishReason.LENGTH and done.frames == len(want.frames)


@pytest.mark.exactness
def test_eight_concurrent_requests_equal_the_reference(stages, builder, messages, expected):
    pipe = Pipeline(stages, builder).run(CASES, messages)
    assert_equals_reference(pipe, expected, BY_ID)
    assert_clean(pipe)
    # They really overlapped: some talker step made frames for at least 5 requests at once.
    per_step = defaultdict(int)
    for steps in pipe.frame_steps.values():
        for s in steps:
            per_step[s] += 1
    assert max(per_step.values()) >= 5


@pytest.mark.exactness
def test_the_device_samplers_equal_the_reference(stages, builder, messages, expected):
    # The cuda default (services/runtime/lm/device_sampling.py) on CPU tensors: the thinker's tokens and
    # the talker's layer-0 codes (generate's repetition penalty 1.05 from each slot's seen mask) drawn in
    # one batched pass each, copied back once a step; the same ids as generate's.
    pipe = Pipeline(stages, builder, device_sampling=True).run(CASES, messages)
    assert pipe.thinker.sampler is not None and pipe.talker.sampler is not None
    assert_equals_reference(pipe, expected, BY_ID)
    assert_clean(pipe)


def test_seeded_draws_on_the_device_replay_whatever_shares_the_batch(stages, builder, messages, expected):
    # Each draw's noise is a hash of the request's seed and the draw's place (device_sampling.py), so a
    # seeded request's text and frames are the same alone and among others joining at other steps,
    # and another seed draws others.
    def sampling(seed: int) -> tuple[SamplingConfig, SamplingConfig]:
        return (SamplingConfig(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=seed),
                SamplingConfig(temperature=0.9, top_k=50, repetition_penalty=TALKER_REPETITION_PENALTY, seed=seed))

    cases = CASES[:4]
    together = Pipeline(stages, builder, device_sampling=True, sampling=sampling(5)).run(cases, messages)
    assert_clean(together)
    mine = replace(BY_ID["image-aiden"], join_step=0)
    alone = Pipeline(stages, builder, device_sampling=True, sampling=sampling(5)).run([mine], messages)
    other = Pipeline(stages, builder, device_sampling=True, sampling=sampling(6)).run([mine], messages)
    rid = mine.request_id
    assert together.tokens[rid] == alone.tokens[rid] and together.frames[rid] == alone.frames[rid]
    assert (other.tokens[rid], other.frames[rid]) != (alone.tokens[rid], alone.frames[rid])
    assert any(together.frames[c.request_id] != expected[c.request_id].frames for c in cases)  # not greedy


class HostSyncs(TorchDispatchMode):
    """What makes the host wait for the device, as a cuda run would: `.item()` (`_local_scalar_dense`),
    `nonzero` (its size is data) and copies to the CPU, from another device or asked for explicitly
    (`to("cpu", copy=True)`: the device path's one copy, counted here on CPU tensors too). Not counted
    while `paused` (inside the LM's forward, a graph replay on cuda). NOTE: on CPU tensors `.cpu()`,
    `.tolist()` and `int()` dispatch nothing, so the host path's syncs are not seen here (the meta
    device's counts in tests/gpu/step_counts.py see them)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if self.paused:
            pass
        elif func in (aten._local_scalar_dense.default, aten.nonzero.default):
            self.count += 1
        elif func is aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            self.count += 1
        elif func is aten.to.dtype_layout and kwargs.get("device") == torch.device("cpu") \
                and (kwargs.get("copy") or args[0].device.type != "cpu"):  # `to` kept whole under inference_mode
            self.count += 1
        elif func is aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            self.count += 1
        return func(*args, **kwargs)


def test_a_decode_step_on_the_device_path_copies_to_the_host_once(stages, builder, messages):
    # Both stages, sampled (penalty, top-k, top-p) and greedy rows side by side: around the LM's forward
    # (on cuda a graph replay; here the eager MoE routing's nonzero would count), every step that only
    # decodes makes one host transfer (the [B] ids; the talker's [B, 16] codes, its code predictor
    # loop included), however many rows.
    greedy = (SamplingConfig(), SamplingConfig(repetition_penalty=TALKER_REPETITION_PENALTY))
    sampled = (SamplingConfig(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=1),
               SamplingConfig(temperature=0.9, top_k=50, repetition_penalty=TALKER_REPETITION_PENALTY, seed=1))
    cases = [replace(c, join_step=0) for c in CASES[:4]]
    pipe = Pipeline(stages, builder, exact=False, device_sampling=True,
                    sampling={c.request_id: sampled if i % 2 else greedy for i, c in enumerate(cases)})
    counts: dict[str, list[tuple[int, int]]] = {"thinker": [], "talker": []}  # (rows, syncs) of decode-only steps
    syncs = HostSyncs()
    for name in counts:
        engine = getattr(pipe, name)
        engine.model.register_forward_pre_hook(lambda *_: setattr(syncs, "paused", True))
        engine.model.register_forward_hook(lambda *_: setattr(syncs, "paused", False))
        schedule, step = engine.scheduler.schedule, engine.step
        plans = []
        engine.scheduler.schedule = lambda schedule=schedule, plans=plans: plans.append(schedule()) or plans[-1]

        def counted(step=step, plans=plans, name=name):
            syncs.count = 0
            with syncs:
                events = step()
            if plans[-1].decode and not plans[-1].prefill:
                counts[name].append((len(plans[-1].decode), syncs.count))
            return events

        engine.step = counted
    pipe.run(cases, messages)
    for name, steps in counts.items():
        assert max(rows for rows, _ in steps) >= 3, name  # batches of several rows were counted
        assert {count for _, count in steps} == {1}, (name, steps)


@pytest.mark.exactness
def test_eight_concurrent_requests_through_the_invariant_gemm_equal_generate_through_it(stages, builder, messages,
                                                                                      tiny_checkpoint):
    # --exact-batching gemm: every linear layer and expert through omni's GEMM on both sides, so
    # the oracle is generate run through the same op (plain generate's bits are MKL's).
    expected = reference_results(tiny_checkpoint, CASES, messages, gemm=True)
    pipe = Pipeline(stages, builder, gemm=True).run(CASES, messages)
    assert pipe.thinker.exact_report.kernels.linear is KernelPath.GEMM
    assert_equals_reference(pipe, expected, BY_ID)
    assert_clean(pipe)


@pytest.mark.exactness
def test_a_step_runs_the_code_predictor_once_for_its_prefilled_and_decoded_rows(stages, builder, messages, expected,
                                                                               monkeypatch):
    # TalkerEngine.end_step: a prefill's first frame joins the decode batch's code predictor
    # instead of running its 15 steps for one row alone; the frames stay the reference's.
    calls = []
    predict = TalkerEngine.predict_residuals

    def counted(self, states, past_hidden):
        calls.append(len(states))
        return predict(self, states, past_hidden)

    monkeypatch.setattr(TalkerEngine, "predict_residuals", counted)
    pipe = Pipeline(stages, builder).run(CASES, messages)
    steps_with_frames = {s for steps in pipe.frame_steps.values() for s in steps}
    assert len(calls) == len(steps_with_frames) and sum(calls) == sum(len(f) for f in pipe.frames.values())
    assert_equals_reference(pipe, expected, BY_ID)


def test_inexact_batching_still_runs(stages, builder, messages):
    # exact_batching=False: plain batched GEMMs (the GPU default). On the 2-core dev box every
    # request's text ids and frames still matched the reference; not asserted: only that every
    # request runs to its end with whole frames.
    cases = [replace(c, join_step=i) for i, c in enumerate(CASES[:4])]
    pipe = Pipeline(stages, builder, exact=False).run(cases, messages)
    for c in cases:
        assert len(pipe.tokens[c.request_id]) == c.max_new_tokens
        assert len(pipe.frames[c.request_id]) == c.talker_max_new_tokens - 1
        assert all(len(frame) == stages[1].config.talker_config.num_code_groups for frame in pipe.frames[c.request_id])
    assert_clean(pipe)


@pytest.mark.exactness
def test_slow_text_waits_without_blocking_another_request(stages, builder, messages, expected):
    slow, fast = BY_ID["text-chelsie"], BY_ID["audio-chelsie"]
    cases = [replace(slow, join_step=0), replace(fast, join_step=0)]
    pipe = Pipeline(stages, builder, text_every={slow.request_id: 3}).run(cases, messages)
    waited = pipe.waited[slow.request_id]
    fast_steps = pipe.frame_steps[fast.request_id]
    # While the slow request held its slot waiting for text, the other one kept making frames:
    # every step it waited before the fast one ended made a frame for the fast one.
    overlap = [s for s in waited if s <= fast_steps[-1]]
    assert len(overlap) >= 5
    assert set(overlap) <= set(fast_steps)
    assert not set(waited) & set(pipe.frame_steps[slow.request_id])  # it really sat those steps out
    # The fast request was never held back: one frame per step from its first to its last.
    assert fast_steps == list(range(fast_steps[0], fast_steps[0] + len(fast_steps)))
    # The slow one took more steps than it has frames, yet its frames are the reference's.
    slow_steps = pipe.frame_steps[slow.request_id]
    assert slow_steps[-1] - slow_steps[0] + 1 > 2 * len(slow_steps)
    assert_equals_reference(pipe, expected, [slow.request_id, fast.request_id])
    assert_clean(pipe)


@pytest.mark.exactness
def test_abort_mid_batch_frees_the_talker_slot(stages, builder, messages, expected):
    keep, drop = BY_ID["text-ethan"], BY_ID["image-aiden"]
    pipe = Pipeline(stages, builder)
    pipe.add(keep, messages[keep.request_id])
    pipe.add(drop, messages[drop.request_id])
    while len(pipe.frames[drop.request_id]) < 3:
        pipe.step()
    assert pipe.talker.running == 2
    pipe.abort(drop.request_id)
    assert pipe.talker.running == 1 and len(pipe.talker.scheduler.free_slots) == SLOTS - 1
    pipe.talker.abort(drop.request_id)  # twice: no double free
    assert len(pipe.talker.scheduler.free_slots) == SLOTS - 1
    pipe.talker.add_input(drop.request_id, TextEnd())  # late text for a gone request is dropped
    frames_before = len(pipe.frames[drop.request_id])
    while pipe.busy():
        pipe.step()
    assert len(pipe.frames[drop.request_id]) == frames_before
    assert_equals_reference(pipe, expected, [keep.request_id])
    assert_clean(pipe)


def start_talker_only(pipe: Pipeline, case: Case, messages) -> None:
    """Prefill the thinker and start the talker request, handing it no text."""
    pipe.add(case, messages[case.request_id])
    for rid, event in pipe.thinker.step():
        if isinstance(event, Prefilled):
            pipe.on_thinker_event(rid, event)
    pipe.thinker.abort(case.request_id)


def test_abort_of_a_request_waiting_for_text_leaves_no_work(stages, builder, messages):
    case = BY_ID["text-ethan"]
    pipe = Pipeline(stages, builder)
    start_talker_only(pipe, case, messages)
    assert pipe.talker.queue_depth == 1 and not pipe.talker.has_work()  # no row 0 yet: not prefilled
    hidden = stages[0].config.thinker_config.text_config.hidden_size
    pipe.talker.add_input(case.request_id, TextRow(torch.zeros(hidden)))
    assert pipe.talker.has_work()
    events = pipe.talker.step()  # prefilled with row 0: frame 0; frame 1 needs row 1
    assert [type(e) for _, e in events] == [Frame]
    assert pipe.talker.running == 1 and not pipe.talker.has_work()
    pipe.talker.abort(case.request_id)
    assert pipe.talker.running == 0 and not pipe.talker.has_work()
    assert_clean(pipe)


def test_text_that_ends_before_any_row_ends_the_talker_request(stages, builder, messages):
    case = BY_ID["text-ethan"]
    pipe = Pipeline(stages, builder)
    start_talker_only(pipe, case, messages)
    pipe.talker.add_input(case.request_id, TextEnd())
    assert pipe.talker.step() == [(case.request_id, TalkerDone(FinishReason.STOP, 0))]
    assert_clean(pipe)


def test_an_aborted_request_leaves_no_row_for_the_steps_code_predictor(stages):
    # A step that raised after a prefill queued its row (end_step never ran) fails its requests
    # through abort: the next step must not make a frame for one of them.
    talker_stage = stages[1]
    cfg = talker_stage.config
    engine = TalkerEngine(talker_stage.model, cfg, engine_config=TalkerEngineConfig(
        max_batch_size=2, num_slots=2, max_model_len=MAX_MODEL_LEN))
    hidden = cfg.thinker_config.text_config.hidden_size
    gen = torch.Generator().manual_seed(0)
    ids = [cfg.im_start_token_id, cfg.user_token_id, 20, 21, cfg.im_start_token_id, cfg.assistant_token_id, 23]
    for rid in ("gone", "kept"):
        engine.add(rid, TalkerJob(prompt_token_ids=ids, prompt_embeds=torch.randn(len(ids), hidden, generator=gen),
                                  multimodal_positions=[], multimodal_hidden=torch.zeros(0, hidden),
                                  tts_embeds=torch.randn(3, hidden, generator=gen),
                                  speaker_id=int(next(iter(cfg.talker_config.speaker_id.values()))),
                                  sampling=SamplingConfig(max_new_tokens=8), prompt_len=talker_prompt_len(ids, cfg)))
        for _ in range(4):
            engine.add_input(rid, TextRow(torch.randn(hidden, generator=gen)))
    plan = engine.scheduler.schedule()
    engine.prefill("gone", plan.slots["gone"])  # its row waits for end_step, which never comes
    engine.abort("gone")
    events = engine.step()  # prefills "kept"
    assert {rid for rid, _ in events} == {"kept"} and all(isinstance(e, Frame) for _, e in events)


@pytest.mark.exactness
@pytest.mark.slow  # three generate calls through the invariant GEMM beside the pipeline: make test-slow (CI)
def test_a_conversation_s_turns_from_both_prefix_caches_equal_generate_on_the_history(stages, builder,
                                                                                     tiny_checkpoint):
    """Three turns, each re-sending the history (the model's replies included), through one thinker
    and one talker with prefix caches (--exact-batching gemm: hits exact by construction): every
    turn's ids and frames are generate's on the whole history, and both caches hit (the talker's
    prompt repeats every earlier user turn)."""
    pipe = Pipeline(stages, builder, gemm=True, prefix_cache_mb=8)
    runner = ReferenceRunner(tiny_checkpoint, gemm=True)
    history = [ChatMessage(Role.SYSTEM, (Part(text="Be brief."),))]
    for turn, text in enumerate(("Hello there! How are you today?", "Tell me about lighthouses.", "Why?")):
        history.append(ChatMessage(Role.USER, (Part(text=text),)))
        case = Case(f"turn-{turn}", text, "chelsie", False, False, 6, 10, 0)
        pipe.run([case], {case.request_id: list(history)}, max_steps=pipe.steps + 400)
        want = runner.generate(history, voice="chelsie", max_new_tokens=6, talker_max_new_tokens=10)
        assert_equals_reference(pipe, {case.request_id: Expected(want.thinker_token_ids, want.codec_frames)},
                                [case.request_id])
        history.append(ChatMessage(Role.ASSISTANT, (Part(text=want.text),)))
    assert pipe.thinker.prefix_pool.stats.hit_tokens > 0 and pipe.talker.prefix_pool.stats.hit_tokens > 0
    assert pipe.talker.exact_report.paths()["prefix_hit"] == "used"
    assert_clean(pipe)


class _Poisoned(Pipeline):
    """A Pipeline where one request's input turns non-finite: its image's pixels (the thinker's
    prompt) or, from its `row`-th token on, the text rows the thinker hands the talker."""

    def __init__(self, *args, bad: str, where: str, row: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.bad, self.where, self.row = bad, where, row

    def add(self, case: Case, messages) -> None:
        super().add(case, messages)
        if case.request_id == self.bad and self.where == "thinker":
            job = self.jobs[case.request_id]
            job.prompt.pixel_values.fill_(float("nan"))

    def on_thinker_event(self, rid: str, event) -> None:
        super().on_thinker_event(rid, event)
        if rid == self.bad and self.where == "talker" and isinstance(event, Token) and event.index >= self.row:
            queue = self.inbox[rid]
            queue.extend(TextRow(torch.full_like(item.embedding, float("nan"))) if isinstance(item, TextRow) else item
                         for item in [queue.pop() for _ in range(len(queue))][::-1])


@pytest.mark.parametrize(("where", "device_sampling"), [
    ("thinker", False), ("talker", True),
    pytest.param("thinker", True, marks=pytest.mark.slow), pytest.param("talker", False, marks=pytest.mark.slow)],
    ids=["thinker-host", "talker-device", "thinker-device", "talker-host"])
def test_non_finite_logits_end_their_request_alone(stages, builder, messages, expected, where, device_sampling):
    # NaN reaching a request's logits (a bad weight or input) ends that request with RequestFailed (the
    # loop's INTERNAL naming the stage), its slot wiped; no crash, the others still equal generate.
    bad = "image-aiden"
    cases = [c for c in CASES if c.request_id in (bad, "text-ethan", "audio-chelsie", "both-ethan")]
    pipe = _Poisoned(stages, builder, device_sampling=device_sampling, bad=bad, where=where)
    wiped = {engine: [] for engine in ("thinker", "talker")}
    for name in wiped:
        cache = getattr(pipe, name).cache
        cache.wipe = (lambda original, log: lambda slot: (log.append(slot), original(slot)))(cache.wipe, wiped[name])
    pipe.run(cases, messages)
    stages_failed = [where]  # a request the thinker failed is cancelled at the talker, as the servers do
    assert sorted(pipe.failed[bad]) == stages_failed
    for failure in pipe.failed[bad].values():
        assert "non-finite logits" in failure.message and failure.field is None  # INTERNAL, not the client's field
    assert all(len(wiped[stage]) == 1 for stage in stages_failed)
    assert bad not in pipe.done
    assert_equals_reference(pipe, expected, [c.request_id for c in cases if c.request_id != bad])
    assert_clean(pipe)
