"""Proto <-> runtime conversions shared by the stages (services/serving/convert.py)."""

from __future__ import annotations

import pytest

from omni.v1 import common_pb2
from services.base.errors import InvalidArgument
from services.base.finish import FinishReason
from services.runtime.lm.sampling import SamplingConfig
from services.serving.convert import finish_reason_to_proto, sampling_from_proto


def test_every_finish_reason_has_its_proto_value():
    assert {finish_reason_to_proto(r) for r in FinishReason} == {
        common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_CANCELLED}
    assert finish_reason_to_proto(FinishReason.LENGTH) == common_pb2.FINISH_REASON_LENGTH


def test_unset_sampling_fields_take_the_stage_defaults():
    config = sampling_from_proto(common_pb2.SamplingParams(), "talker_sampling", 256, 8192,
                                 default_repetition_penalty=1.05)
    assert config == SamplingConfig(max_new_tokens=256, repetition_penalty=1.05)


def test_set_fields_are_kept_exactly():
    p = common_pb2.SamplingParams(temperature=0.5, top_k=20, top_p=0.75, repetition_penalty=1.25,
                                  max_new_tokens=12, seed=7)
    assert sampling_from_proto(p, "thinker_sampling", 64, 100) == SamplingConfig(
        temperature=0.5, top_k=20, top_p=0.75, repetition_penalty=1.25, max_new_tokens=12, seed=7)


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("temperature", 10.5), ("top_k", -1),
                                          ("top_p", 0.0), ("top_p", 1.01), ("repetition_penalty", 0.0),
                                          ("repetition_penalty", 1e-45), ("repetition_penalty", 0.009),
                                          ("max_new_tokens", 0), ("max_new_tokens", 101)])
def test_out_of_range_fields_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidArgument) as raised:
        sampling_from_proto(common_pb2.SamplingParams(**{field: value}), "thinker_sampling", 64, 100)
    assert raised.value.field == f"thinker_sampling.{field}"


def test_the_documented_bounds_themselves_pass_the_wire():
    # 0.01 and 1e-5 arrive as float32 (0.0099999998, 9.9999997e-06): still the bounds.
    p = common_pb2.SamplingParams(temperature=1e-5, repetition_penalty=0.01)
    config = sampling_from_proto(p, "thinker_sampling", 64, 100)
    assert config.repetition_penalty == p.repetition_penalty and not config.greedy
    assert sampling_from_proto(common_pb2.SamplingParams(temperature=9.9e-6), "thinker_sampling", 64, 100).greedy
