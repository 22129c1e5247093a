"""Admission in one step for the talkers of both families (services/runtime/lm/engine.py `admit`):
a burst of talker prompts packed into one forward where exact batching is off, each with the
codes it gets alone; a prompt over the step's token budget prefilled a chunk a step, with the
whole prefill's bits in gemm mode. Stand-in inputs (seeded rows for the thinker's outputs); the
talker models run for real."""

from __future__ import annotations

import pytest
import torch

from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.qwen3_omni import talker_prompt_len
from services.talker.engine import TalkerEngine, TalkerJob, TextRow
from services.talker.engine_base import Frame, TalkerDone, TalkerEngineConfig, TextEnd
from services.talker.qwen2_5 import Qwen2_5TalkerEngine, Qwen2_5TalkerJob, ReplyPart
from tests.qwen2_5_oracle import load_engine_stages
from tests.talker.test_prefix_cache import assert_same_bits, speak

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

FRAMES = 5
LENGTHS = (3, 11, 30, 7)  # user-part text positions of each prompt


def config(*, exact: str = "off", budget: int = 0, prefills: int = 0) -> TalkerEngineConfig:
    return TalkerEngineConfig(max_batch_size=8, num_slots=8, max_model_len=256, exact_batching=exact != "off",
                              exact_gemm=exact == "gemm", max_prefill_tokens=budget, max_prefills_per_step=prefills)


def qwen3_job(model_config, user: int, seed: int) -> tuple[TalkerJob, list]:
    hidden = model_config.thinker_config.text_config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    ids = [model_config.im_start_token_id, model_config.user_token_id] + list(range(20, 20 + user)) + \
        [model_config.im_start_token_id, model_config.assistant_token_id, 23]
    job = TalkerJob(prompt_token_ids=ids, prompt_embeds=torch.randn(len(ids), hidden, generator=gen),
                    multimodal_positions=[], multimodal_hidden=torch.zeros(0, hidden),
                    tts_embeds=torch.randn(3, hidden, generator=gen),
                    speaker_id=int(next(iter(model_config.talker_config.speaker_id.values()))),
                    sampling=SamplingConfig(max_new_tokens=FRAMES + 1, repetition_penalty=1.05),
                    prompt_len=talker_prompt_len(ids, model_config))
    return job, [TextRow(torch.randn(hidden, generator=gen)) for _ in range(3)] + [TextEnd()]


def qwen2_5_job(model_config, prompt: int, seed: int) -> tuple[Qwen2_5TalkerJob, list]:
    hidden = model_config.thinker_config.text_config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    job = Qwen2_5TalkerJob(torch.randn(prompt, hidden, generator=gen), torch.randn(3, hidden, generator=gen),
                           SamplingConfig(max_new_tokens=FRAMES, repetition_penalty=1.05), eos_ids=())
    return job, [ReplyPart(torch.randn(hidden, generator=gen)) for _ in range(3)] + [TextEnd()]


@pytest.fixture(scope="module", params=["qwen3", "qwen2_5"])
def talker(request):
    """(engine class, model, config, job maker) of each family's talker."""
    if request.param == "qwen3":
        loaded = load_stage(request.getfixturevalue("tiny_checkpoint"), Stage.TALKER)
        return TalkerEngine, loaded.model, loaded.config, qwen3_job
    _, model, model_config = load_engine_stages(request.getfixturevalue("tiny_qwen2_5_checkpoint"))
    return Qwen2_5TalkerEngine, model, model_config, qwen2_5_job


def speak_together(engine, jobs: dict) -> dict[str, list]:
    """Every job added and fed at once, stepped to the end: request id -> its codes."""
    codes: dict[str, list] = {rid: [] for rid in jobs}
    for rid, (job, inputs) in jobs.items():
        engine.add(rid, job)
        for payload in inputs:
            engine.add_input(rid, payload)
    done = set()
    while engine.has_work():
        for rid, event in engine.step():
            if isinstance(event, Frame):
                codes[rid].append(event.codes.tolist())
            elif isinstance(event, TalkerDone):
                done.add(rid)
            elif type(event).__name__ == "Code":
                codes[rid].append(event.code)
    assert done == set(jobs) and engine.running == 0
    return codes


def test_a_burst_of_talker_prompts_is_packed_into_one_forward_with_each_prompt_s_codes(talker):
    engine_cls, model, model_config, make = talker
    jobs = {f"r{i}": make(model_config, n, seed=i) for i, n in enumerate(LENGTHS)}
    alone = speak_together(engine_cls(model, model_config, engine_config=config(prefills=1)), jobs)
    packed = engine_cls(model, model_config, engine_config=config())
    calls: list[int] = []
    handle = packed.stack.module.register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append(kwargs["inputs_embeds"].shape[1]), with_kwargs=True)
    got = speak_together(packed, jobs)
    handle.remove()
    assert calls[0] == sum(job.prompt_len for job, _ in jobs.values())  # every prompt in the first forward
    assert got == alone


@pytest.mark.exactness
def test_a_talker_prompt_over_the_budget_is_prefilled_a_chunk_a_step_with_the_whole_prefill_s_bits(talker):
    engine_cls, model, model_config, make = talker
    job, inputs = make(model_config, 40, seed=9)
    whole = speak(engine_cls(model, model_config, engine_config=config(exact="gemm")), "whole", job, inputs)
    chunked_engine = engine_cls(model, model_config, engine_config=config(exact="gemm", budget=16))
    rows: list[int] = []
    handle = chunked_engine.stack.module.register_forward_pre_hook(
        lambda _m, args, kwargs: rows.append(kwargs["inputs_embeds"].shape[1]), with_kwargs=True)
    chunked = speak(chunked_engine, "chunked", job, inputs)
    handle.remove()
    # A chunk's forward takes the whole prompt's rows (the stack cuts them): one call per 16 positions.
    assert rows.count(job.prompt_len) == -(-job.prompt_len // 16) > 1
    assert_same_bits(chunked, whole, "chunked")
