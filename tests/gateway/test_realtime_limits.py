"""A hosted Realtime API's limits through the gateway, driven by the pinned openai SDK: short-lived
client secrets (`POST /v1/realtime/client_secrets`, a secret minted at one gateway replica opening a
session at another), turn detection's `idle_timeout_ms` and its `input_audio_buffer.timeout_triggered`,
and the maximum session length (OpenAI's `session_expired`, the socket closed going away)."""

from __future__ import annotations

import base64
import json
import time

import openai
import pytest
import websockets.sync.client
from gateway_procs import start_gateway
from openai.types.realtime import InputAudioBufferTimeoutTriggered
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.client_secrets import ClientSecret, mint, signing_keys, verify
from tests.sessions.procs import router as start_router
from tests.sessions.procs import sessions as start_sessions

TOKEN = "server-token"
SECRET_SESSION = {"type": "realtime", "instructions": "Answer in one word.", "output_modalities": ["text"],
                  "max_output_tokens": 3, "audio": {"input": {"turn_detection": None}}}


def wait_for_sessions(gateway, headers: dict | None = None) -> None:
    """Until the gateway's poll found its sessions replica ready (a session opens)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            websockets.sync.client.connect(f"ws://127.0.0.1:{gateway.port}/v1/realtime?model=x",
                                           additional_headers=headers or {}).close()
            return
        except (InvalidStatus, OSError):
            assert time.monotonic() < deadline, "the gateway never took a session"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def replicas(gw_stack, tmp_path_factory):
    """Two gateway replicas with the same token, over a sessions service and a router that take that token
    alone (so a turn runs only if the gateway passed its own token on, never the client's secret)."""
    folder = tmp_path_factory.mktemp("secrets")
    tokens = folder / "tokens"
    tokens.write_text(TOKEN + "\n")
    router = start_router(gw_stack, "--auth-token-file", str(tokens))
    # The sessions service asks the token too: the gateways' load polls and sessions present theirs.
    sessions = start_sessions(router.target, "--auth-token-file", str(tokens))
    gateways = [start_gateway(gw_stack.target, folder, "--sessions", sessions.target, "--auth-token-file", str(tokens),
                              "--model-name", "tiny-qwen3-omni") for _ in range(2)]
    for gateway in gateways:
        wait_for_sessions(gateway, {"Authorization": f"Bearer {TOKEN}"})
    yield gateways
    for process in (*gateways, sessions, router):
        process.stop()


def sdk(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=60)


def test_a_client_secret_minted_at_one_replica_opens_a_session_at_another_with_its_settings(replicas):
    minting, connecting = replicas
    with sdk(minting, TOKEN) as server:
        secret = server.realtime.client_secrets.create(expires_after={"anchor": "created_at", "seconds": 60},
                                                       session=SECRET_SESSION)
    assert secret.value.startswith("ek_") and 0 < secret.expires_at - time.time() <= 60
    assert secret.session.instructions == "Answer in one word."
    with sdk(connecting, secret.value) as browser:
        with browser.realtime.connect(model="tiny-qwen3-omni") as conn:
            created = conn.recv()
            assert created.type == "session.created"
            session = created.session
            assert (session.instructions, session.output_modalities, session.max_output_tokens) == (
                "Answer in one word.", ["text"], 3)
            assert session.audio.input.turn_detection is None
            # A turn: the router (which takes the server's token alone) got the gateway's own token.
            conn.conversation.item.create(item={"type": "message", "role": "user",
                                                "content": [{"type": "input_text", "text": "hello"}]})
            conn.response.create()
            done = next(e for e in conn if e.type == "response.done")
            assert done.response.status in ("completed", "incomplete")
        # A secret is no API key: every other route refuses it, minting included.
        with pytest.raises(openai.AuthenticationError):
            browser.chat.completions.create(model="tiny-qwen3-omni", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.AuthenticationError):
            browser.realtime.client_secrets.create(session=SECRET_SESSION)
        with pytest.raises(openai.AuthenticationError):
            browser.models.list()


def test_a_tampered_or_missing_secret_is_a_401_in_the_handshake(replicas):
    with sdk(replicas[0], TOKEN) as server:
        value = server.realtime.client_secrets.create(session=SECRET_SESSION).value
    tampered = value[:-2] + ("AA" if not value.endswith("AA") else "BB")
    url = f"ws://127.0.0.1:{replicas[1].port}/v1/realtime?model=x"
    for headers in ({"Authorization": f"Bearer {tampered}"}, {}):
        with pytest.raises(InvalidStatus) as refused:
            websockets.sync.client.connect(url, additional_headers=headers)
        assert refused.value.response.status_code == 401


def test_a_browser_presents_its_secret_as_a_subprotocol_as_openais_browser_clients_do(replicas):
    """A browser's WebSocket cannot set Authorization: it offers `realtime` and `openai-insecure-api-key.<secret>`."""
    with sdk(replicas[0], TOKEN) as server:
        value = server.realtime.client_secrets.create(session=SECRET_SESSION).value
    url = f"ws://127.0.0.1:{replicas[1].port}/v1/realtime?model=x"
    with websockets.sync.client.connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{value}"]) as ws:
        assert ws.subprotocol == "realtime"
        created = json.loads(ws.recv(timeout=30))
        assert (created["type"], created["session"]["instructions"]) == ("session.created", "Answer in one word.")
    with pytest.raises(InvalidStatus) as refused:  # the server's own token never goes this way
        websockets.sync.client.connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{TOKEN}"])
    assert refused.value.response.status_code == 401


@pytest.mark.parametrize(("body", "param"), [
    ({"expires_after": {"anchor": "created_at", "seconds": 5}}, "expires_after.seconds"),
    ({"expires_after": {"anchor": "now"}}, "expires_after.anchor"),
    ({"session": {"type": "realtime", "audio": {"input": {"turn_detection": {"threshold": "high"}}}}},
     "session.audio.input.turn_detection.threshold"),
    ({"session": {"type": "transcription"}}, "session.type"),
    ({"ttl": 5}, "ttl"),
])
def test_a_bad_client_secret_request_is_a_400_naming_the_field(replicas, body, param):
    with sdk(replicas[0], TOKEN) as server, pytest.raises(openai.BadRequestError) as refused:
        server.post("/realtime/client_secrets", body=body, cast_to=object)
    assert refused.value.response.json()["error"]["param"] == param


def test_a_secret_expires_and_only_the_servers_tokens_sign_one():
    keys = signing_keys((b"one", b"two"))
    value = mint(ClientSecret(expires_at=1000, session={"instructions": "x"}), keys)
    assert verify(value, keys, now=999) == ClientSecret(1000, {"instructions": "x"})
    assert verify(value, signing_keys((b"two", b"one")), now=999) is not None  # a rotation: any token verifies
    assert verify(value, keys, now=1000) is None  # expired
    assert verify(value, signing_keys((b"other",)), now=999) is None
    assert verify(value.replace("ek_", "ek_x", 1), keys, now=999) is None


def test_idle_timeout_ms_triggers_a_timeout_turn_with_the_apis_events(client):
    with client.realtime.connect(model="tiny-qwen3-omni") as conn:
        assert conn.recv().type == "session.created"
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 2,
                                     "audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                            "idle_timeout_ms": 1000}}}})
        updated = conn.recv()
        assert updated.type == "session.updated"
        assert updated.session.audio.input.turn_detection.idle_timeout_ms == 1000
        conn.input_audio_buffer.append(audio=base64.b64encode(bytes(2 * 2400)).decode())  # 100 ms of silence
        events = []
        for event in conn:
            events.append(event)
            if event.type == "response.done":
                break
    [triggered] = [e for e in events if e.type == "input_audio_buffer.timeout_triggered"]
    assert isinstance(triggered, InputAudioBufferTimeoutTriggered)
    assert triggered.audio_end_ms >= triggered.audio_start_ms >= 0
    [committed] = [e for e in events if e.type == "input_audio_buffer.committed"]
    assert committed.item_id == triggered.item_id
    seen = [e.type for e in events]
    assert seen.index("input_audio_buffer.timeout_triggered") < seen.index("input_audio_buffer.committed") \
        < seen.index("response.created")
    assert events[-1].response.metadata is None  # the server's response, nobody's response.create


def test_an_idle_timeout_out_of_range_or_on_semantic_vad_is_refused_naming_it(client):
    with client.realtime.connect(model="tiny-qwen3-omni") as conn:
        assert conn.recv().type == "session.created"
        for detection in ({"type": "server_vad", "idle_timeout_ms": 500},
                          {"type": "semantic_vad", "idle_timeout_ms": 5000}):
            conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": detection}}})
            error = conn.recv()
            assert error.type == "error", error
            assert error.error.param == "session.audio.input.turn_detection.idle_timeout_ms"


@pytest.fixture(scope="module")
def short_sessions_gateway(gw_stack, tmp_path_factory):
    """A gateway in front of a sessions service whose sessions last at most 2 s."""
    sessions = start_sessions(gw_stack.target, "--session-max-duration-s", "2")
    gateway = start_gateway(gw_stack.target, tmp_path_factory.mktemp("short"), "--sessions", sessions.target)
    wait_for_sessions(gateway)
    yield gateway
    gateway.stop()
    sessions.stop()


def test_a_session_at_its_maximum_length_gets_session_expired_and_the_socket_closes_going_away(short_sessions_gateway):
    with websockets.sync.client.connect(f"ws://127.0.0.1:{short_sessions_gateway.port}/v1/realtime?model=x") as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        while (event := json.loads(ws.recv(timeout=30)))["type"] != "error":
            pass
        assert (event["error"]["code"], event["error"]["type"]) == ("session_expired", "invalid_request_error")
        assert "maximum" in event["error"]["message"]
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
    assert closed.value.rcvd.code == 1001
