"""The gateway as a service: models, health, metrics, no model code in its process, and a caller
that goes away freeing the request in every stage."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from services.tools.soak import read_router_gauges, wait_settled

SETTLE_S = 10.0


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


def test_models_lists_the_checkpoint_and_its_voices(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-qwen3-omni"]
    card = models.data[0].model_dump()
    assert sorted(card["voices"]) == ["aiden", "chelsie", "ethan"] and card["default_voice"] == "ethan"
    assert client.models.retrieve("tiny-qwen3-omni").id == "tiny-qwen3-omni"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_health_is_the_routers_readiness(gateway):
    assert get(f"{gateway.url}/health") == (200, json.dumps({"status": "ok"}, separators=(",", ":")))


def test_metrics_count_requests(gateway, client):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    status, text = get(f"{gateway.url}/metrics")
    assert status == 200
    assert 'omni_gateway_requests_total{endpoint="chat",status="200"}' in text
    assert "omni_gateway_first_event_seconds_bucket" in text and "omni_gateway_in_flight 0.0" in text
    # Its start-up heap is frozen out of garbage collection, as every stage's (services/serving/gc_heap.py).
    frozen = next(line for line in text.splitlines() if line.startswith("omni_gc_frozen_objects "))
    assert float(frozen.split()[1]) > 10_000


def test_the_gateway_process_holds_no_model_code(gateway):
    with open(f"/proc/{gateway.popen.pid}/maps") as f:
        maps = f.read()
    assert "libtorch" not in maps
    probe = ("import sys, gateway.server; bad = [m for m in sys.modules if m.split('.')[0] in "
             "('torch', 'transformers') or m.startswith(('services.thinker', 'services.talker', "
             "'services.code2wav', 'services.runtime.inputs.prompt', 'services.runtime.model.qwen3_omni'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def outcomes(gw_stack) -> dict:
    return read_router_gauges(gw_stack.metrics_url).outcomes


def assert_freed(gw_stack, before: dict) -> None:
    replicas = {stage: tuple(gw_stack.addresses(stage)) for stage in ("thinker", "talker", "code2wav")}
    settled = wait_settled(replicas, gw_stack.metrics_url, SETTLE_S)
    assert settled.idle, f"not idle {SETTLE_S} s after the disconnect: {settled.busy()}, router {settled.router}"
    assert all(load.in_flight == 0 for load in settled.loads)
    # The request ended at the router without completing (it would run for seconds more).
    after = outcomes(gw_stack)
    assert after.get("ok", 0) == before.get("ok", 0)
    assert sum(after.values()) == sum(before.values()) + 1


def long_chat() -> dict:
    # Measured: 3000 tokens (never the end token) in about 7 s on this stack, so the request is still
    # running when the caller leaves.
    return dict(model="m", messages=[{"role": "user", "content": "Write an essay."}], max_tokens=3000,
                modalities=["text", "audio"])


def test_streaming_client_disconnect_frees_every_stage(client, gw_stack):
    before = outcomes(gw_stack)
    stream = client.chat.completions.create(**long_chat(), audio={"voice": "ethan", "format": "pcm16"}, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.model_dump().get("audio", {}) and \
                chunk.choices[0].delta.model_dump()["audio"].get("data"):
            break  # the first audio: thinker, talker and code2wav are all working on it
    stream.close()  # the HTTP connection goes away mid-stream
    assert_freed(gw_stack, before)


def test_non_streaming_client_timeout_frees_every_stage(gateway, gw_stack):
    before = outcomes(gw_stack)
    impatient = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=1.5)
    started = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(**long_chat(), audio={"voice": "ethan", "format": "wav"})
    assert time.monotonic() - started < 60
    assert_freed(gw_stack, before)


def test_reply_text_drops_the_end_tokens_text():
    from gateway.chat import reply_text
    from gateway.config import GatewayConfig
    from omni.v1 import omni_pb2

    config = GatewayConfig()
    end = omni_pb2.TextDelta(text="!<|im_end|>", token_ids=[config.end_token_id])
    assert reply_text(end, config) == "!"
    assert reply_text(omni_pb2.TextDelta(text="<|im_end|>", token_ids=[5]), config) == "<|im_end|>"


def test_accepted_connections_get_tcp_nodelay():
    """Streamed events are small writes: without TCP_NODELAY each waits for the client's delayed
    ACK (measured: +40 ms to the first delta on a kept-alive connection before the fix)."""
    import asyncio
    import socket

    from gateway.server import listen_socket

    async def run() -> int:
        seen = asyncio.get_running_loop().create_future()

        async def handle(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = listen_socket("127.0.0.1", 0)
        server = await asyncio.start_server(handle, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        value = await seen
        writer.close()
        server.close()
        return value

    assert asyncio.run(run()) != 0


def test_a_non_streamed_reply_splices_its_base64_audio_into_valid_json():
    """The render that runs in a worker thread: the audio's base64 goes straight into the JSON text."""
    import base64
    import io

    import numpy as np
    import soundfile as sf

    from gateway.chat import AUDIO_PLACEHOLDER, _render_completion

    chunks = [np.linspace(-0.5, 0.5, 2400, dtype=np.float32), np.zeros(1200, np.float32)]
    payload = {"choices": [{"message": {"audio": {"id": "audio_x", "data": AUDIO_PLACEHOLDER, "transcript": "a\"b"}}}]}
    body = json.loads(_render_completion(payload, chunks, "wav"))
    audio = body["choices"][0]["message"]["audio"]
    assert audio["transcript"] == 'a"b'
    samples, rate = sf.read(io.BytesIO(base64.b64decode(audio["data"], validate=True)), dtype="float32")
    assert rate == 24000 and samples.shape == (3600,)
    assert json.loads(_render_completion({"x": 1}, None, "wav")) == {"x": 1}


def test_a_seed_is_an_int64_or_a_uint64_and_anything_wider_is_refused_naming_it():
    from pydantic import ValidationError

    from gateway.convert import chat_to_proto
    from gateway.schemas import ChatCompletionRequest

    def seed_of(seed: int) -> int:
        request = ChatCompletionRequest(model="omni", messages=[{"role": "user", "content": "hi"}], seed=seed)
        return chat_to_proto(request, None)[0].thinker_sampling.seed

    assert seed_of(7) == 7 and seed_of(2**64 - 1) == 2**64 - 1
    assert seed_of(-1) == 2**64 - 1 and seed_of(-(2**63)) == 2**63  # the int64's bits
    for wide in (2**64, -(2**63) - 1):
        with pytest.raises(ValidationError, match="seed"):
            ChatCompletionRequest(model="omni", messages=[{"role": "user", "content": "hi"}], seed=wide)
