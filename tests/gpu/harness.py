"""In-process harness of the GPU-path tests: thinker -> talker as the servers wire them (without
gRPC), and engines wired for CUDA graphs with the capture left out (the static steps run eagerly)."""

from __future__ import annotations

from collections import defaultdict

import torch

from services.runtime.lm.kv_slots import SlotKVCache
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.lm.static_decode import SlotDecodeGraphs
from services.runtime.model.settings import GraphSettings
from services.talker.engine import TalkerEngine
from services.talker.engine_base import Frame, TalkerDone, TalkerEngineConfig
from services.talker.graphs import PredictorGraphs, frame_after, talker_step
from services.thinker.engine import (
    Finished,
    Prefilled,
    ThinkerEngine,
    ThinkerEngineConfig,
    ThinkerJob,
    Token,
)
from services.thinker.graphs import thinker_step
from services.tools.inprocess import Handoff

BUCKETS = (1, 2, 4, 8)  # 3 requests run padded to 4
SLOTS = 4
SPAN = 20  # the shortest decode span (then 40, 80, 96: --max-model-len): the tests' rows cross 40


def run_pipeline(thinker, talker, builder, config, requests: dict, voice: str = "chelsie",
                 max_steps: int = 200) -> tuple[dict, dict, dict]:
    """requests: request_id -> (messages, thinker max tokens, talker max tokens).
    Returns (text ids, frames, talker ends), each keyed by request id."""
    tokens: dict[str, list[int]] = defaultdict(list)  # request_id -> text ids
    frames: dict[str, list[torch.Tensor]] = defaultdict(list)  # request_id -> [num_code_groups] codes
    done: dict[str, TalkerDone] = {}  # request_id -> the talker's end
    handoff = Handoff(builder, config)  # the servers' adapters, in-process
    jobs = {}
    for rid, (messages, max_new, _talker_max) in requests.items():
        jobs[rid] = ThinkerJob(builder.build(messages), SamplingConfig(max_new_tokens=max_new), True)
        thinker.add(rid, jobs[rid])
    for _ in range(max_steps):
        if not (thinker.has_work() or talker.has_work()):
            break
        if thinker.has_work():
            for rid, event in thinker.step():
                if isinstance(event, Prefilled):
                    talker.add(rid, handoff.talker_job(
                        event, jobs[rid], SamplingConfig(max_new_tokens=requests[rid][2], repetition_penalty=1.05),
                        voice))
                elif isinstance(event, Token):
                    tokens[rid].append(event.token_id)
                    for payload in handoff.talker_inputs(event):
                        talker.add_input(rid, payload)
                else:
                    assert isinstance(event, Finished)
        if talker.has_work():
            for rid, event in talker.step():
                if isinstance(event, Frame):
                    frames[rid].append(event.codes)
                elif isinstance(event, TalkerDone):
                    done[rid] = event
    else:
        raise AssertionError("the pipeline did not finish")
    return tokens, frames, done


class EagerStatic:
    """A GPU engine's graph hooks with the capture left out: the static step runs eagerly."""

    def __init__(self, graphs):
        self.graphs = graphs

    def decode(self, x, position_ids, slots, rows=None, more=()):
        return self.graphs.run_padded(x, position_ids, slots, rows, more)

    @property
    def then(self):
        return self.graphs.then

    def predict(self, past_hidden, codes0):
        return self.graphs.run_padded(past_hidden, codes0)


def static_engines(thinker_stage, talker_stage, device: str = "cpu", device_sampling: bool | None = None):
    """Engines wired as with --cuda-graphs on (scratch slot, hooks; with device sampling, the draws
    inside the static step), minus the capture."""
    settings = GraphSettings(False, BUCKETS)
    cfg = dict(max_batch_size=SLOTS, num_slots=SLOTS, max_model_len=96, exact_batching=False,
               device_sampling=device_sampling)
    thinker = ThinkerEngine(thinker_stage.model, thinker_stage.config, device, ThinkerEngineConfig(**cfg))
    talker = TalkerEngine(talker_stage.model, talker_stage.config, device, TalkerEngineConfig(**cfg))
    predictor = PredictorGraphs(talker.model, settings, False, device, talker.dtype)
    # With device sampling the talker's decode step makes the whole frame (one graph a step).
    frame = frame_after(predictor, talker.residual_sampler) if talker.sampler is not None else None
    for engine, step, then in ((thinker, thinker_step, None), (talker, talker_step, frame)):
        text_config = engine.model.config.text_config
        engine.cache = SlotKVCache.for_config(text_config, SLOTS + 1, 96, engine.dtype, device)
        engine.graphs = EagerStatic(SlotDecodeGraphs(step(engine.model, engine.cache), engine.cache, SLOTS,
                                                     settings, False, "test", device, shortest_span=SPAN,
                                                     sampler=engine.sampler, then=then))
    talker.predictor_graphs = EagerStatic(predictor)
    return thinker, talker
