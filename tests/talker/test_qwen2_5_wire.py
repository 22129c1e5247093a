"""The Qwen2.5-Omni half of the thinker -> talker contract (stages.proto: TalkerStart fields 13-14,
TextToken.reply): the family adapters' conversion functions (services/thinker/qwen2_5_adapter.py,
services/talker/qwen2_5_adapter.py), and what they refuse, naming the field.
tests/talker/test_qwen2_5_engine.py runs sixteen requests through them against generate."""

from __future__ import annotations

import pytest
import torch

from omni.v1 import omni_pb2, stages_pb2
from services.base.errors import InvalidArgument
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from services.serving.wire import tensor_to_proto
from services.talker.config import TalkerConfig
from services.talker.engine_base import TalkerEngineConfig, TextEnd
from services.talker.qwen2_5 import ReplyPart
from services.talker.qwen2_5_adapter import qwen2_5_input_from_proto, qwen2_5_job_from_proto
from services.thinker.engine import Token
from services.thinker.qwen2_5 import Qwen2_5Prefilled
from services.thinker.qwen2_5_adapter import qwen2_5_talker_start, qwen2_5_text_tokens

P, MAX_MODEL_LEN = 7, 64


@pytest.fixture(scope="module")
def config(tiny_qwen2_5_checkpoint):
    from transformers import Qwen2_5OmniConfig

    return Qwen2_5OmniConfig.from_pretrained(tiny_qwen2_5_checkpoint)


@pytest.fixture(scope="module")
def hidden(config) -> int:
    return config.thinker_config.text_config.hidden_size


def talker_config() -> TalkerConfig:
    return TalkerConfig(serving=ServingConfig(), model=ModelConfig(checkpoint="unused"),
                        engine=TalkerEngineConfig(max_model_len=MAX_MODEL_LEN), default_max_new_tokens=16)


def start(hidden: int, **request) -> stages_pb2.TalkerStart:
    event = Qwen2_5Prefilled(list(range(P)), torch.randn(P, hidden), torch.randn(3, hidden))
    return qwen2_5_talker_start(omni_pb2.GenerateRequest(request_id="r", **request), stages_pb2.Route(), event)


def test_start_round_trips_the_prefill_payload(config, hidden):
    message = start(hidden, voice="Ethan")
    job = qwen2_5_job_from_proto(stages_pb2.TalkerStart.FromString(message.SerializeToString()), config,
                                 talker_config())
    assert message.voice == "Ethan" and list(message.prompt_token_ids) == list(range(P))
    assert job.prompt_hidden.shape == (P, hidden) and job.text_embeds.shape == (3, hidden)
    assert (job.sampling.max_new_tokens, job.sampling.repetition_penalty) == (16, 1.05)  # the talker's defaults


@pytest.mark.parametrize("field, change", [
    ("start.prompt_hidden", lambda s, h: s.ClearField("prompt_hidden")),
    ("start.prompt_hidden", lambda s, h: s.prompt_hidden.CopyFrom(tensor_to_proto(torch.zeros(P - 1, h)))),
    ("start.prompt_hidden", lambda s, h: s.prompt_hidden.CopyFrom(tensor_to_proto(torch.zeros(P, h, dtype=torch.int64)))),
    ("start.text_embeds", lambda s, h: s.text_embeds.CopyFrom(tensor_to_proto(torch.zeros(2, h)))),
    ("talker_sampling.max_new_tokens", lambda s, h: setattr(s.sampling, "max_new_tokens", MAX_MODEL_LEN - P - 1)),
])
def test_a_bad_start_is_refused_naming_the_field(config, hidden, field, change):
    message = start(hidden)
    change(message, hidden)
    with pytest.raises(InvalidArgument) as raised:
        qwen2_5_job_from_proto(message, config, talker_config())
    assert raised.value.field == field


def test_one_text_token_per_token_but_the_last_each_with_its_reply_part(hidden):
    replies = [torch.randn(hidden) for _ in range(3)]
    events = [Token(10, 0, None, False), Token(11, 1, None, False, replies[0]), Token(12, 2, None, False, replies[1]),
              Token(13, 3, None, True, replies[2])]
    messages, previous = [], None
    for event in events:
        messages += qwen2_5_text_tokens(event, previous)
        previous = event.token_id
    assert [m.WhichOneof("event") for m in messages] == ["token", "token", "token", "finished"]
    assert [m.token.token_id for m in messages[:3]] == [10, 11, 12]
    inputs = [qwen2_5_input_from_proto(m, hidden) for m in messages]
    assert all(isinstance(i, ReplyPart) for i in inputs[:3]) and isinstance(inputs[3], TextEnd)
    assert all(torch.equal(i.reply, r) for i, r in zip(inputs, replies))


@pytest.mark.parametrize("message", [
    stages_pb2.TalkerInput(token=stages_pb2.TextToken(token_id=1)),  # Qwen3-Omni's row, no reply part
    stages_pb2.TalkerInput(token=stages_pb2.TextToken(token_id=1, reply=tensor_to_proto(torch.zeros(5)))),
    stages_pb2.TalkerInput(),
])
def test_a_bad_text_token_is_refused(hidden, message):
    with pytest.raises(InvalidArgument) as raised:
        qwen2_5_input_from_proto(message, hidden)
    assert raised.value.field == "token.reply"
