"""Every error the gateway returns, in OpenAI's shape, as the openai SDK raises it.

Besides the package's gateway: a second router over the same stages that wants a bearer token
and admits one request at a time with no queue (401, 429), a gateway towards it that knows no
voices (so the router's own voice check answers), one whose router deadline is 1 ms (504), and
one towards a port where nothing listens (503)."""

from __future__ import annotations

import base64
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from gateway_procs import start_gateway, start_router

from services.tools.client import build_request, connect
from services.tools.launcher import free_port, health_status

TOKEN = "s3cret-token"


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture(scope="module")
def auth_router(gw_stack, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text(TOKEN + "\n")
    popen, port = start_router(gw_stack, "--auth-token-file", str(tokens), "--max-in-flight", "1",
                               "--max-queue", "0")
    target = f"127.0.0.1:{port}"
    try:
        for _ in range(600):
            if health_status(target, "omni.v1.Omni") == "SERVING":
                break
            assert popen.poll() is None, "auth router exited"
            import time

            time.sleep(0.1)
        yield target
    finally:
        popen.terminate()
        popen.wait(timeout=20)


@pytest.fixture(scope="module")
def auth_gateway(auth_router, tmp_path_factory):
    running = start_gateway(auth_router, tmp_path_factory.mktemp("gw-auth"))  # no --checkpoint: voices unknown
    yield running
    running.stop()


@pytest.fixture(scope="module")
def deadline_gateway(gw_stack, tmp_path_factory):
    running = start_gateway(gw_stack.target, tmp_path_factory.mktemp("gw-deadline"), "--timeout-s", "0.001")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def short_gateway(gw_stack, tmp_path_factory):
    """A 1 s router deadline (long answers fail mid-stream) and a 1 MB body limit."""
    running = start_gateway(gw_stack.target, tmp_path_factory.mktemp("gw-short"), "--timeout-s", "1",
                            "--max-body-mb", "1")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def dead_gateway(tmp_path_factory):
    running = start_gateway(f"127.0.0.1:{free_port()}", tmp_path_factory.mktemp("gw-dead"))
    yield running
    running.stop()


def sdk(gateway, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=60)


USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("kwargs, param", [
    ({"messages": []}, "messages"),
    ({"n": 2}, "n"),
    ({"temperature": 5.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 100000}, "max_tokens"),  # the thinker's limit: the router's BadRequest names the field
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "https://example.com/cat.png"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                 "input_audio": {"data": "not base64!", "format": "wav"}}]}]},
     "messages[0].content[0].input_audio.data"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(b"RIFF garbage").decode(), "format": "wav"}}]}]},
     "messages[0].content[0].input_audio"),  # unreadable: the thinker says so
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                    "tool_call_id": "1"}]}, "messages[0].content[0]"),
    ({"tools": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["x"]}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"stop": ["\n"]}, "stop"),
    ({"modalities": ["audio"], "audio": {"voice": "ethan", "format": "wav"}}, "modalities"),
    ({"modalities": ["text", "audio"]}, "audio"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "nobody", "format": "wav"}}, "audio.voice"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "aiff"}}, "audio.format"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}, "stream": True}, "audio.format"),
])
def test_chat_400_names_the_param(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        result = client.chat.completions.create(**{"model": "m", "messages": USER, "max_tokens": 4, **kwargs})
        if kwargs.get("stream"):
            list(result)
    error = error_of(caught.value)
    assert caught.value.status_code == 400
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_unknown_voice_lists_the_voices(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=USER, modalities=["text", "audio"],
                                       audio={"voice": "nobody", "format": "wav"})
    message = error_of(caught.value)["message"]
    assert "nobody" in message and all(v in message for v in ("chelsie", "ethan", "aiden"))


def test_router_checks_the_voice_when_the_gateway_knows_none(auth_gateway):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(auth_gateway, TOKEN).chat.completions.create(model="m", messages=USER, modalities=["text", "audio"],
                                                         audio={"voice": "nobody", "format": "wav"}, max_tokens=2)
    error = error_of(caught.value)
    assert error["param"] == "audio.voice" and "chelsie" in error["message"]


@pytest.mark.parametrize("kwargs, param", [
    ({"speed": 1.5}, "speed"),
    ({"response_format": "aac"}, "response_format"),
    ({"voice": "nobody"}, "voice"),
    ({"instructions": "Whisper."}, "instructions"),
    ({"input": ""}, "input"),
])
def test_speech_400_names_the_param(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(**{"model": "m", "input": "Hello.", "voice": "ethan", **kwargs})
    error = error_of(caught.value)
    assert error["param"] == param, error


def test_401_without_the_routers_token_and_the_token_passes_through(auth_gateway):
    with pytest.raises(openai.AuthenticationError) as caught:
        sdk(auth_gateway, "wrong").chat.completions.create(model="m", messages=USER, max_tokens=2)
    assert caught.value.status_code == 401 and error_of(caught.value)["code"] == "invalid_api_key"
    ok = sdk(auth_gateway, TOKEN).chat.completions.create(model="m", messages=USER, max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_429_with_retry_after_when_the_router_is_full(auth_gateway, auth_router):
    channel, stub = connect(auth_router)
    # Hold the router's only place: a long request, admitted once its first response arrives.
    held = stub.Generate(build_request("hold", max_new_tokens=64, talker_max_new_tokens=2000), timeout=120,
                         metadata=(("authorization", f"Bearer {TOKEN}"),))
    try:
        next(held)
        with pytest.raises(openai.RateLimitError) as caught:
            sdk(auth_gateway, TOKEN).chat.completions.create(model="m", messages=USER, max_tokens=2)
        assert caught.value.status_code == 429
        assert caught.value.response.headers["retry-after"] == "1"  # the router's RetryInfo: 1 s
        assert error_of(caught.value)["type"] == "rate_limit_error"
    finally:
        held.cancel()
        channel.close()


def test_503_when_the_router_is_unreachable(dead_gateway):
    with pytest.raises(openai.InternalServerError) as caught:
        sdk(dead_gateway).chat.completions.create(model="m", messages=USER, max_tokens=2)
    assert caught.value.status_code == 503 and error_of(caught.value)["code"] == "service_unavailable"
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(f"{dead_gateway.url}/health", timeout=10)
    assert health.value.code == 503


def test_504_when_the_deadline_passes(deadline_gateway):
    with pytest.raises(openai.APIStatusError) as caught:
        sdk(deadline_gateway).chat.completions.create(model="m", messages=USER, max_tokens=2)
    assert caught.value.status_code == 504 and error_of(caught.value)["type"] == "timeout_error"


def test_a_failure_mid_stream_is_an_sse_error_event(short_gateway):
    # "Write an essay." runs 3000 tokens (about 7 s here): the 1 s deadline passes mid-stream.
    stream = sdk(short_gateway).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Write an essay."}], max_tokens=3000, stream=True)
    received = 0
    with pytest.raises(openai.APIError) as caught:
        for _chunk in stream:
            received += 1
    assert received > 1  # the 200 and some deltas came first
    assert "deadline" in str(caught.value).lower() or "DEADLINE" in str(caught.value)


def test_413_over_the_body_limit_declared_or_chunked(short_gateway):
    import http.client

    big = "x" * (2 << 20)
    with pytest.raises(openai.APIStatusError) as caught:
        sdk(short_gateway).chat.completions.create(model="m", messages=[{"role": "user", "content": big}])
    assert caught.value.status_code == 413 and error_of(caught.value)["code"] == "request_too_large"
    connection = http.client.HTTPConnection("127.0.0.1", short_gateway.port, timeout=30)
    body = iter([b'{"model": "m", "messages": [{"role": "user", "content": "', big.encode(), b'"}]}'])
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})  # chunked
    response = connection.getresponse()
    assert response.status == 413
    connection.close()


def test_unknown_route_is_openai_shaped(gateway):
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{gateway.url}/v1/embeddings", timeout=10)
    assert caught.value.code == 404
    import json

    assert set(json.loads(caught.value.read())["error"]) == {"message", "type", "param", "code"}


def test_grpc_status_codes_map_as_documented():
    from gateway.errors import from_rpc

    class Fake(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "x"

        def trailing_metadata(self):
            return ()

    assert {c: from_rpc(Fake(c)).status for c in (
        grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)} == {
        grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
        grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
        grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.INTERNAL: 500}
