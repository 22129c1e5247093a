"""The talker cuts its chunks to the listener's clock (services/runtime/chunking.py, "running
dry") on real gRPC: a talker and a code2wav server from their factories on loopback, fed as the
thinker service feeds the talker, but with the text rows paced slower than real time (frame f
waits for row f + 1). The talker then sends the frames it has instead of letting a half-made
chunk reach the listener after the audio before it has played; with `--delivery-ms 0` it keeps
to the schedule, 4 then 8 frames."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from omni.v1 import stages_pb2, stages_pb2_grpc
from services.code2wav.config import Code2WavConfig
from services.code2wav.server import create_server as create_code2wav
from services.runtime.chunking import ChunkPolicy
from services.runtime.inputs.prompt import ChatMessage, Part, PromptBuilder, Role
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.model.checkpoint import Stage, load_stage
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from services.serving.status import error_info
from services.serving.wire import audio_from_proto, frames_from_proto
from services.talker.server import TalkerConfig
from services.talker.server import create_server as create_talker
from services.thinker.engine import Prefilled, ThinkerEngine, ThinkerJob, Token
from services.thinker.qwen3_adapter import Qwen3ThinkerAdapter
from services.tools.client import build_request
from services.tools.launcher import free_port
from tests.serving.inprocess import serving

LOOPBACK = ServingConfig(host="127.0.0.1", port=0, stream_idle_timeout_s=30.0)
TOKENS = 14  # thinker tokens: 13 text rows, then the text's end
FRAMES = 12  # talker_max_new_tokens 13: a first chunk of 4, then 8 the schedule would send at once
ROW_GAP_S = 0.15  # a row, so a frame, every 150 ms: about half real time (a frame plays 80 ms)


@pytest.fixture(scope="module")
def talker_stream(tiny_checkpoint):
    """A greedy request's TalkerStart and its TalkerInputs, made as the thinker service makes them."""
    loaded = load_stage(tiny_checkpoint, Stage.THINKER)
    inputs = PromptBuilder(tiny_checkpoint, loaded.config).build(
        [ChatMessage(Role.USER, (Part(text="Tell me about the sea."),))])
    thinker = ThinkerEngine(loaded.model, loaded.config)
    job = ThinkerJob(inputs, SamplingConfig(max_new_tokens=TOKENS), True)
    thinker.add("r", job)
    adapter = Qwen3ThinkerAdapter(str(tiny_checkpoint), loaded.config, None)
    request = build_request("Tell me about the sea.", max_new_tokens=TOKENS, talker_max_new_tokens=FRAMES + 1)
    request.return_codec_frames = True
    start, rows, previous = None, [], None
    while thinker.has_work():
        for _, event in thinker.step():
            if isinstance(event, Prefilled):
                start = adapter.talker_start(request, stages_pb2.Route(), event, job)
            if isinstance(event, Token):
                rows += adapter.talker_inputs(event, previous)
                previous = event.token_id
    return start, rows


def chunks_sent(tiny_checkpoint, talker_stream, delivery_ms: float) -> tuple[list[int], int, int]:
    """(frames in each chunk the talker sent code2wav, audio samples the caller got, frames made).
    Every audio chunk names the frames decoded when it was made (AudioChunk.end_frame), more each
    time, all of them at the last."""
    start, rows = talker_stream
    model = ModelConfig(checkpoint=str(tiny_checkpoint))

    async def scenario():
        talker_config = TalkerConfig(serving=LOOPBACK, model=model, chunks=ChunkPolicy(delivery_ms=delivery_ms))
        async with serving(create_code2wav, Code2WavConfig(serving=LOOPBACK, model=model)) as (code2wav, _), \
                serving(create_talker, talker_config) as (talker, _), \
                grpc.aio.insecure_channel(talker) as channel:
            first = stages_pb2.TalkerStart()
            first.CopyFrom(start)
            first.route.code2wav = code2wav

            async def inputs():
                yield stages_pb2.TalkerInput(start=first)
                for i, row in enumerate(rows):
                    if i > 0:
                        await asyncio.sleep(ROW_GAP_S)
                    yield row

            return [out async for out in stages_pb2_grpc.TalkerStub(channel).Speak(inputs(), timeout=60)]

    outputs = asyncio.run(scenario())
    sizes = [frames_from_proto(o.codec_frames).shape[0] for o in outputs if o.HasField("codec_frames")]
    audio = [o.audio for o in outputs if o.HasField("audio")]
    ends = [a.end_frame for a in audio]
    assert ends == sorted(set(ends)) and ends[-1] == sum(sizes), ends
    return sizes, sum(audio_from_proto(a).size for a in audio), outputs[-1].final.codec_frames


def test_a_talker_slower_than_real_time_sends_the_frames_it_has(tiny_checkpoint, talker_stream):
    sizes, samples, frames = chunks_sent(tiny_checkpoint, talker_stream, delivery_ms=100)
    assert frames == FRAMES and sum(sizes) == FRAMES and samples == FRAMES * 1920 - 555
    assert sizes[0] == 4 and sizes[1] < 8, sizes  # cut early: the 8-frame chunk would come 1.2 s later


def test_with_delivery_ms_zero_the_talker_keeps_to_the_schedule(tiny_checkpoint, talker_stream):
    sizes, samples, frames = chunks_sent(tiny_checkpoint, talker_stream, delivery_ms=0)
    assert sizes == [4, 8] and frames == FRAMES and samples == FRAMES * 1920 - 555


def test_a_code2wav_that_cannot_be_reached_is_named_in_a_message_before_the_status(tiny_checkpoint, talker_stream):
    """No fallback left for code2wav: the talker's last message is a StageFailure naming it, then its
    UNAVAILABLE status names it too. The message is what a caller still writing text rows gets when
    its write races the end of the stream and grpc replaces the status with a local INTERNAL one."""
    start, rows = talker_stream
    model = ModelConfig(checkpoint=str(tiny_checkpoint))
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there

    async def scenario():
        async with serving(create_talker, TalkerConfig(serving=LOOPBACK, model=model)) as (talker, _), \
                grpc.aio.insecure_channel(talker) as channel:
            first = stages_pb2.TalkerStart()
            first.CopyFrom(start)
            first.route.code2wav = nowhere
            writing = asyncio.Event()

            async def inputs():  # the caller goes on writing: its side stays open
                yield stages_pb2.TalkerInput(start=first)
                yield rows[0]
                await writing.wait()

            outputs = []
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for out in stages_pb2_grpc.TalkerStub(channel).Speak(inputs(), timeout=60):
                    outputs.append(out)
            writing.set()
            return outputs, raised.value

    outputs, error = asyncio.run(scenario())
    assert outputs[-1].WhichOneof("event") == "failed", outputs
    assert (outputs[-1].failed.stage, outputs[-1].failed.replica) == ("code2wav", nowhere)
    assert error.code() is grpc.StatusCode.UNAVAILABLE and error_info(error).metadata["stage"] == "code2wav"
