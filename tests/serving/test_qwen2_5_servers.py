"""The thinker and talker servers on a Qwen2.5-Omni checkpoint, built by their own `create_server`
factories on port 0 and called over real gRPC: they load their stage (`load_for_serving`) and pick
the family's adapter (its engine and stage-message conversions) by the checkpoint's model_type,
and concurrent requests' text ids and codec frames equal transformers' generate (ReferenceRunner,
tests/qwen2_5_oracle.py). Code2wav is the real stage too (streaming Token2Wav): every request's
audio has one codec token's samples per frame (its values against generate's Token2Wav call are
checked through the launcher's stack, tests/tools/test_launcher_qwen2_5.py).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from omni.v1 import stages_pb2, stages_pb2_grpc
from services.code2wav.config import Code2WavConfig
from services.code2wav.server import create_server as create_code2wav
from services.code2wav.token2wav_engine import Token2WavEngine
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from services.talker import server as talker_server
from services.talker.engine_base import TalkerEngineConfig
from services.talker.qwen2_5 import Qwen2_5TalkerEngine
from services.thinker import server as thinker_server
from services.thinker.engine import ThinkerEngineConfig
from services.thinker.qwen2_5 import Qwen2_5ThinkerEngine
from services.tools.client import build_request
from services.tools.reference import ReferenceRunner
from tests.qwen2_5_oracle import BY_ID, TALKER_EOS_IDS, generate_reference, media
from tests.qwen2_5_oracle import case_messages as oracle_messages
from tests.serving.inprocess import serving

LOOPBACK = ServingConfig(host="127.0.0.1", port=0, stream_idle_timeout_s=60.0)
CASES = [BY_ID[rid] for rid in ("text-ethan", "audio-chelsie", "image-ethan", "both-chelsie", "short-ethan")]


# One torch thread (see tests/thinker/test_qwen2_5_engine.py): the oracle's generate on two
# contended threads took 90 s here, on one about a second. The servers keep it (ModelConfig.threads 0).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_each_server_has_an_adapter_for_every_family():
    from services.base.families import Family

    assert set(thinker_server.ADAPTERS) == set(talker_server.ADAPTERS) == set(Family)
    assert thinker_server.ADAPTERS[Family.QWEN2_5_OMNI].engine is Qwen2_5ThinkerEngine
    assert talker_server.ADAPTERS[Family.QWEN2_5_OMNI].engine is Qwen2_5TalkerEngine


@pytest.mark.slow  # 6 s of servers; the Qwen2.5 engines' exactness stays in make test: make test-slow (CI)
@pytest.mark.exactness
def test_concurrent_requests_over_grpc_equal_generate(tiny_qwen2_5_checkpoint):
    files = media()
    runner = ReferenceRunner(tiny_qwen2_5_checkpoint)
    # The servers' talker end ids must be generate's defaults: the oracle takes them from transformers.
    expected = {c.request_id: generate_reference(runner, oracle_messages(c, files), c.voice, c.max_new_tokens,
                                                 c.talker_max_new_tokens, TALKER_EOS_IDS) for c in CASES}
    model = ModelConfig(checkpoint=str(tiny_qwen2_5_checkpoint))
    engine = dict(max_batch_size=8, num_slots=8, max_model_len=256)

    async def one(stub, route, case):
        audio = files[case.audio][1] if case.audio else None
        image = files[case.image][1] if case.image else None
        request = build_request(case.prompt, case.system, audio, image, voice=case.voice.lower(),
                                max_new_tokens=case.max_new_tokens, talker_max_new_tokens=case.talker_max_new_tokens,
                                return_codec_frames=True, request_id=case.request_id)
        ids, codes, final = [], [], None
        async for response in stub.Generate(stages_pb2.ThinkerRequest(request=request, route=route), timeout=60):
            kind = response.WhichOneof("event")
            if kind == "text":
                ids += response.text.token_ids
            elif kind == "codec_frames":
                assert response.codec_frames.num_code_groups == 1 and response.codec_frames.first_frame == len(codes)
                codes += response.codec_frames.ids
            elif kind == "final":
                final = response.final
        return ids, codes, final

    async def scenario():
        thinker_config = thinker_server.ThinkerConfig(serving=LOOPBACK, model=model, engine=ThinkerEngineConfig(**engine))
        talker_config = talker_server.TalkerConfig(serving=LOOPBACK, model=model, engine=TalkerEngineConfig(**engine))
        code2wav_config = Code2WavConfig(serving=LOOPBACK, model=model)
        async with serving(create_code2wav, code2wav_config) as (code2wav, code2wav_engine), \
                serving(talker_server.create_server, talker_config) as (talker, talker_engine), \
                serving(thinker_server.create_server, thinker_config) as (thinker, thinker_engine), \
                grpc.aio.insecure_channel(thinker) as channel:
            assert isinstance(thinker_engine, Qwen2_5ThinkerEngine) and isinstance(talker_engine, Qwen2_5TalkerEngine)
            assert isinstance(code2wav_engine, Token2WavEngine)
            stub = stages_pb2_grpc.ThinkerStub(channel)
            route = stages_pb2.Route(talker=talker, code2wav=code2wav)
            results = await asyncio.gather(*(one(stub, route, case) for case in CASES))
            return dict(zip([c.request_id for c in CASES], results))

    results = asyncio.run(scenario())
    for case in CASES:
        ids, codes, final = results[case.request_id]
        want = expected[case.request_id]
        assert ids == want.token_ids, f"{case.request_id}: text ids"
        assert codes == want.codes and len(codes) == case.talker_max_new_tokens, f"{case.request_id}: codec ids"
        assert final.usage.codec_frames == len(codes) and final.usage.text_tokens == len(ids)
        assert final.usage.audio_seconds == pytest.approx(len(codes) * 480 / 24000), f"{case.request_id}: audio"
