"""Bad input gets INVALID_ARGUMENT naming the field, and the stack keeps serving."""

from __future__ import annotations

import grpc
import pytest

from omni.v1 import omni_pb2, stages_pb2, stages_pb2_grpc
from services.serving.grpc_server import channel_options
from services.tools.client import build_request, collect


def bad_requests(wav_bytes):
    empty = omni_pb2.GenerateRequest()
    no_content = omni_pb2.GenerateRequest()
    no_content.messages.add(role=omni_pb2.ROLE_USER)
    too_long = build_request("hello " * 5000)
    bad_role = build_request("hi")
    bad_role.messages[0].role = omni_pb2.ROLE_UNSPECIFIED
    return {
        "messages": empty,
        "messages[0].content": no_content,
        "prompt is": too_long,  # longer than the model's limit
        "voice": build_request("hi", voice="nobody"),
        "messages[0].content[0].audio": build_request("hi", audio=b"RIFF not really a wav"),
        "messages[0].content[0].image": build_request("hi", image=b"\x89PNG garbage"),
        "thinker_sampling.temperature": _with(build_request("hi"), "thinker_sampling", temperature=-1.0),
        "thinker_sampling.top_p": _with(build_request("hi"), "thinker_sampling", top_p=1.5),
        "thinker_sampling.max_new_tokens": _with(build_request("hi"), "thinker_sampling", max_new_tokens=0),
        "talker_sampling.top_k": _with(build_request("hi"), "talker_sampling", top_k=-3),
        "messages[0].role": bad_role,
        "output_modalities": _modalities(build_request("hi"), [omni_pb2.MODALITY_AUDIO]),
    }


def _with(request, field, **values):
    for key, value in values.items():
        setattr(getattr(request, field), key, value)
    return request


def _modalities(request, modalities):
    del request.output_modalities[:]
    request.output_modalities.extend(modalities)
    return request


def test_bad_requests_get_invalid_argument_naming_the_field_and_the_stack_keeps_serving(omni, wav_bytes):
    for field, request in bad_requests(wav_bytes).items():
        with pytest.raises(grpc.RpcError) as info:
            collect(omni, request, timeout=30)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (field, info.value.details())
        assert field in info.value.details(), (field, info.value.details())
    ok = collect(omni, build_request("still there?", max_new_tokens=4, talker_max_new_tokens=6), timeout=60)
    assert len(ok.thinker_token_ids) == 4 and ok.audio_chunks


def test_text_only_never_touches_the_talker_and_audio_names_a_dead_talker(stack):
    # Call the thinker directly with a route whose talker does not exist.
    with grpc.insecure_channel(f"127.0.0.1:{stack.port('thinker')}", options=channel_options()) as channel:
        thinker = stages_pb2_grpc.ThinkerStub(channel)
        route = stages_pb2.Route(talker="127.0.0.1:9", code2wav="127.0.0.1:9")
        text_only = build_request("hi", text_only=True, max_new_tokens=5, request_id="t1")
        responses = list(thinker.Generate(stages_pb2.ThinkerRequest(request=text_only, route=route), timeout=30))
        assert [r.WhichOneof("event") for r in responses[:-1]] == ["text"] * (len(responses) - 1)
        assert sum(len(r.text.token_ids) for r in responses[:-1]) == 5 and responses[-1].HasField("final")

        with_audio = build_request("hi", max_new_tokens=5, request_id="t2")
        with pytest.raises(grpc.RpcError) as info:
            list(thinker.Generate(stages_pb2.ThinkerRequest(request=with_audio, route=route), timeout=30))
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "talker" in info.value.details()
