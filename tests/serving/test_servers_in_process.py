"""Each stage's servicer, built by its own `create_server` factory on port 0 inside the test
process (STYLE point 7), called over real gRPC on loopback: the contracts a stage offers the
stage before it, without the launcher or the router."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from omni.v1 import common_pb2, stages_pb2, stages_pb2_grpc
from services.code2wav.config import Code2WavConfig
from services.code2wav.server import create_server as create_code2wav
from services.code2wav.vocoder import forward_batch
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from services.serving.status import field_violations
from services.serving.wire import audio_from_proto, frames_to_proto
from services.talker.engine_base import TalkerEngineConfig
from services.talker.server import TalkerConfig
from services.talker.server import create_server as create_talker
from services.thinker.server import ThinkerConfig
from services.thinker.server import create_server as create_thinker
from services.tools.client import build_request
from tests.serving.inprocess import serving

LOOPBACK = ServingConfig(host="127.0.0.1", port=0, stream_idle_timeout_s=30.0)


def test_code2wav_decodes_streamed_frames_like_one_vocoder_forward(tiny_checkpoint):
    vocoder = load_stage(tiny_checkpoint, Stage.CODE2WAV).model
    frames = torch.randint(0, 64, (30, 16), generator=torch.Generator().manual_seed(3))  # [n, Q]
    truth = forward_batch(vocoder, frames[None])[0].numpy()

    async def scenario():
        config = Code2WavConfig(serving=LOOPBACK, model=ModelConfig(checkpoint=str(tiny_checkpoint)))
        async with serving(create_code2wav, config) as (address, _), grpc.aio.insecure_channel(address) as channel:
            stub = stages_pb2_grpc.Code2WavStub(channel)

            async def inputs():
                yield stages_pb2.Code2WavInput(start=stages_pb2.Code2WavStart(request_id="r"))
                for first in range(0, 30, 7):
                    yield stages_pb2.Code2WavInput(frames=frames_to_proto(frames[first:first + 7], first))
                yield stages_pb2.Code2WavInput(end=stages_pb2.CodecEnd())

            outputs = [out async for out in stub.Decode(inputs(), timeout=60)]
            load = await stub.GetLoad(common_pb2.LoadRequest(), timeout=5)
            return outputs, load

    outputs, load = asyncio.run(scenario())
    audio = np.concatenate([audio_from_proto(o.audio) for o in outputs if o.HasField("audio")])
    assert outputs[-1].final.audio_samples == len(audio) == len(truth)
    assert np.abs(audio - truth).max() < 1e-4 * max(np.abs(truth).max(), 1e-3)
    assert load.stage == "code2wav" and load.in_flight == 0


def test_code2wav_refuses_a_stream_that_does_not_start_with_start(tiny_checkpoint):
    async def scenario():
        config = Code2WavConfig(serving=LOOPBACK, model=ModelConfig(checkpoint=str(tiny_checkpoint)))
        async with serving(create_code2wav, config) as (address, _), grpc.aio.insecure_channel(address) as channel:
            async def inputs():
                yield stages_pb2.Code2WavInput(end=stages_pb2.CodecEnd())

            with pytest.raises(grpc.aio.AioRpcError) as raised:
                [out async for out in stages_pb2_grpc.Code2WavStub(channel).Decode(inputs(), timeout=30)]
            return raised.value

    err = asyncio.run(scenario())
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(err) == [("start", "the first message must be start")]


def test_the_thinker_checks_a_request_against_the_limits_the_talker_reports(tiny_checkpoint):
    """One owner per setting: the talker's --max-new-tokens-limit lives with the talker, and the
    thinker refuses a request above it before any output, having learnt it from the talker."""
    model = ModelConfig(checkpoint=str(tiny_checkpoint))

    async def scenario():
        talker_config = TalkerConfig(serving=LOOPBACK, model=model, engine=TalkerEngineConfig(max_model_len=512),
                                     max_new_tokens_limit=1000)
        async with serving(create_talker, talker_config) as (talker, _), \
                serving(create_thinker, ThinkerConfig(serving=LOOPBACK, model=model)) as (thinker, _), \
                grpc.aio.insecure_channel(talker) as talker_channel, \
                grpc.aio.insecure_channel(thinker) as thinker_channel:
            report = await stages_pb2_grpc.TalkerStub(talker_channel).GetLoad(common_pb2.LoadRequest(), timeout=5)
            stub = stages_pb2_grpc.ThinkerStub(thinker_channel)
            route = stages_pb2.Route(talker=talker, code2wav="127.0.0.1:1")  # code2wav is never reached
            errors = []
            for talker_tokens in (1001, 600):
                request = build_request("hi", max_new_tokens=2, talker_max_new_tokens=talker_tokens)
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    [r async for r in stub.Generate(stages_pb2.ThinkerRequest(request=request, route=route), timeout=30)]
                errors.append(raised.value)
            return report.limits, errors

    limits, (too_many, too_long) = asyncio.run(scenario())
    assert (limits.max_model_len, limits.max_new_tokens_limit) == (512, 1000)
    assert too_many.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(too_many)[0] == ("talker_sampling.max_new_tokens", "must be in [1, 1000], got 1001")
    assert too_long.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(too_long)[0][0] == "talker_sampling.max_new_tokens"
    assert "exceeds the talker's per-request cache (512)" in too_long.details()
