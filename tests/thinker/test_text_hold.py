"""Audio first in the thinker engine (`HoldText` / `ReleaseText`, services/thinker/engine.py): a
held request stops at its lead until released or until its time is up, rides along in the steps
other requests take, never holds anyone else back, and, released, produces exactly the tokens it
produces unheld."""

from __future__ import annotations

import time

import pytest
import torch

from services.runtime.inputs.prompt import PromptBuilder
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import Stage, load_stage
from services.thinker.engine import (
    HoldText,
    ReleaseText,
    ThinkerEngine,
    ThinkerEngineConfig,
    ThinkerJob,
    Token,
)
from services.tools.reference import messages_from_args
from tests.threads import torch_threads

TOKENS = 12


@pytest.fixture(scope="module")
def stage(tiny_checkpoint):
    previous = torch.get_num_threads()
    torch.set_num_threads(torch_threads(1))
    yield load_stage(tiny_checkpoint, Stage.THINKER), tiny_checkpoint
    torch.set_num_threads(previous)


def engine_and_job(stage, prompt: str = "Tell me about the sea.", tokens: int = TOKENS):
    loaded, checkpoint = stage
    engine = ThinkerEngine(loaded.model, loaded.config, engine_config=ThinkerEngineConfig(
        max_batch_size=4, num_slots=4, max_model_len=128))
    built = PromptBuilder(checkpoint, loaded.config).build(messages_from_args(prompt, None, None, None))
    return engine, ThinkerJob(built, SamplingConfig(max_new_tokens=tokens), want_talker_inputs=True)


def drain(engine, tokens: dict) -> int:
    """Step while the engine has work; every Token goes to tokens[request_id]. Returns the steps."""
    steps = 0
    while engine.has_work():
        for request_id, event in engine.step():
            if isinstance(event, Token):
                tokens.setdefault(request_id, []).append(event.token_id)
        steps += 1
        assert steps < 100
    return steps


@pytest.mark.exactness
def test_held_request_stops_at_its_lead_and_resumes_on_release_with_the_same_tokens(stage):
    engine, job = engine_and_job(stage)
    free: dict = {}
    engine.add("free", job)
    drain(engine, free)

    engine, job = engine_and_job(stage)
    held: dict = {}
    engine.add("held", job)
    engine.add_input("held", HoldText(lead=5, seconds=60))
    drain(engine, held)
    assert held["held"] == free["free"][:5]  # stopped at the lead, with nothing left to do
    assert not engine.has_work() and engine.running == 1  # it keeps its slot
    assert 59 < engine.wake_in() <= 60  # the loop would wake for its deadline
    engine.add_input("held", ReleaseText())
    drain(engine, held)
    assert held["held"] == free["free"]
    assert engine.running == 0 and engine.wake_in() is None


def test_hold_ends_by_itself_at_its_deadline(stage):
    engine, job = engine_and_job(stage)
    tokens: dict = {}
    engine.add("r", job)
    engine.add_input("r", HoldText(lead=3, seconds=0.2))
    drain(engine, tokens)
    if len(tokens["r"]) == 3:  # (a very slow machine may pass the deadline before the third token)
        assert not engine.has_work()
        time.sleep(max(engine.wake_in(), 0) + 0.01)
    drain(engine, tokens)  # has_work ends the expired hold
    assert len(tokens["r"]) == TOKENS and engine.running == 0


def test_a_held_request_rides_along_the_steps_another_takes_and_holds_no_one_back(stage):
    engine, long_job = engine_and_job(stage, tokens=3 * TOKENS)
    _, job = engine_and_job(stage)
    tokens: dict = {}
    engine.add("held", long_job)
    engine.add_input("held", HoldText(lead=2, seconds=60))
    engine.add("other", job)
    drain(engine, tokens)
    assert len(tokens["other"]) == TOKENS  # never held back
    assert 2 < len(tokens["held"]) < 3 * TOKENS  # past its lead beside the other, stopped after it
    assert not engine.has_work()
    engine.abort("held")  # aborting a held request frees its slot
    assert engine.running == 0 and engine.wake_in() is None and not engine.has_work()


def test_inputs_for_gone_requests_are_ignored_and_others_refused(stage):
    engine, job = engine_and_job(stage)
    engine.add_input("nobody", HoldText(lead=2, seconds=1))
    engine.add_input("nobody", ReleaseText())
    assert engine.wake_in() is None
    engine.add("r", job)
    with pytest.raises(ValueError, match="no streamed input"):
        engine.add_input("r", object())


def test_the_server_holds_only_at_light_load_with_a_talker_that_knows_its_first_chunk(stage):
    # ThinkerServicer.hold_text, the server's half: which spoken requests get a HoldText.
    from types import SimpleNamespace

    from omni.v1 import common_pb2
    from services.serving.open_streams import LIGHT_LOAD_STREAMS
    from services.thinker.server import AUDIO_FIRST_HOLD_S, AUDIO_FIRST_MARGIN, ThinkerServicer

    engine, _ = engine_and_job(stage)
    sent = []
    servicer = ThinkerServicer.__new__(ThinkerServicer)
    servicer.engine = engine
    servicer.config = SimpleNamespace(audio_first=True)
    servicer.loop = SimpleNamespace(in_flight=1, add_input=lambda key, payload: sent.append(payload))
    talker = common_pb2.StageLimits(text_rows_to_first_chunk=4)
    assert servicer.hold_text("k", talker)
    assert sent == [HoldText(4 + AUDIO_FIRST_MARGIN, AUDIO_FIRST_HOLD_S)]
    servicer.loop.in_flight = LIGHT_LOAD_STREAMS + 1  # busy: no hold
    assert not servicer.hold_text("k", talker)
    servicer.loop.in_flight = 1
    assert not servicer.hold_text("k", common_pb2.StageLimits())  # the talker does not say (Qwen2.5-Omni)
    servicer.config.audio_first = False
    assert not servicer.hold_text("k", talker)
    servicer.config.audio_first, servicer.engine = True, object()  # another backend (vLLM) takes no holds
    assert not servicer.hold_text("k", talker)
    assert len(sent) == 1
