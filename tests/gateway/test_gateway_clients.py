"""Callers that misbehave, and where the gateway's calls go: a client that stops reading, one that
leaves while its request waits in the router's queue, one that leaves a non-streamed request; two
router processes behind one gateway; bearer tokens on every route but the probes.

Clients here are raw sockets where the test needs to stop reading or leave at a chosen moment (no
HTTP library lets a caller hold a response unread); the rest is the openai SDK."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest
from gateway_procs import start_gateway, start_router

from services.tools.client import build_request, connect
from services.tools.launcher import free_port, health_status
from services.tools.soak import read_router_gauges, wait_settled

SETTLE_S = 10.0
TOKEN = "gw-token"


def post(port: int, path: str, body: dict, rcvbuf: int | None = None) -> socket.socket:
    """A request sent on a raw socket (a small receive buffer: the client's window shuts soon)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def assert_settled(gw_stack, within_s: float = SETTLE_S) -> None:
    replicas = {stage: tuple(gw_stack.addresses(stage)) for stage in ("thinker", "talker", "code2wav")}
    settled = wait_settled(replicas, gw_stack.metrics_url, within_s)
    assert settled.idle, f"not idle {within_s} s after the client left: {settled.busy()}, router {settled.router}"


@pytest.fixture(scope="module")
def watched_gateway(gw_stack, tiny_checkpoint, tmp_path_factory):
    """Towards the stack, with a 1 s send timeout, 16 kB send buffers (32 kB as Linux doubles it) and
    its log kept."""
    running = start_gateway(gw_stack.target, tmp_path_factory.mktemp("gw-watched"), "--send-timeout-s", "1",
                            "--send-buffer-kb", "16", "--checkpoint", str(tiny_checkpoint))
    yield running
    running.stop()


def test_a_client_that_stops_reading_frees_the_request(watched_gateway, gw_stack):
    """It reads nothing after the request: its TCP window shuts, the gateway's writes block once the
    socket buffers are full (measured: the stack here makes about 25 kB of pcm a second on 2 busy
    cores, so some 4 s for 100 kB of buffers), and after --send-timeout-s (1 s here) the gateway ends
    the stream and cancels the router call (it held a router admission slot until the 600 s deadline
    before)."""
    before = read_router_gauges(gw_stack.metrics_url).outcomes
    sock = post(watched_gateway.port, "/v1/audio/speech", {
        "model": "m", "input": "Hello world, this is a long one.", "voice": "ethan", "response_format": "pcm",
        "max_audio_frames": 3000}, rcvbuf=4096)  # about 11 MB of pcm16: far more than the socket buffers
    try:
        until(lambda: read_router_gauges(gw_stack.metrics_url).in_flight == 1, 30, "the request never started")
        assert_settled(gw_stack, within_s=60)  # the 3000 frames take minutes
        after = read_router_gauges(gw_stack.metrics_url).outcomes
        assert sum(after.values()) == sum(before.values()) + 1 and after.get("ok", 0) == before.get("ok", 0)
    finally:
        sock.close()
    assert "client stopped reading" in watched_gateway.log.read_text()


def test_a_non_streamed_disconnect_frees_the_request_without_an_error_logged(watched_gateway, gw_stack):
    sock = post(watched_gateway.port, "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "Write an essay."}], "max_tokens": 3000,
        "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}})
    until(lambda: read_router_gauges(gw_stack.metrics_url).in_flight == 1, 30, "the request never started")
    sock.close()
    assert_settled(gw_stack)
    log = watched_gateway.log.read_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


@pytest.fixture(scope="module")
def queue_router(gw_stack):
    """A second router over the stack's stages: one request at a time, the next ones queued (2 min)."""
    metrics = free_port()
    popen, port = start_router(gw_stack, "--max-in-flight", "1", "--max-queue", "4", "--queue-timeout-s", "120",
                               "--metrics-port", str(metrics))
    target = f"127.0.0.1:{port}"
    try:
        until(lambda: health_status(target, "omni.v1.Omni") == "SERVING", 60, "router not ready")
        yield target, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        popen.terminate()
        popen.wait(timeout=20)


def test_a_client_that_leaves_while_queued_leaves_the_queue_at_once(queue_router, tmp_path):
    """The router's only place is held; a gateway request waits in its queue for its first event. The
    client leaves: the request leaves the queue now, while the held one still runs (before, the gateway
    noticed only when the first event came, after the held request)."""
    target, metrics_url = queue_router
    gateway = start_gateway(target, tmp_path)
    channel, stub = connect(target)
    held = stub.Generate(build_request("hold", max_new_tokens=64, talker_max_new_tokens=3000), timeout=300)
    try:
        next(held)
        sock = post(gateway.port, "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        until(lambda: read_router_gauges(metrics_url).queue_depth == 1, 30, "the request never queued")
        sock.close()
        until(lambda: read_router_gauges(metrics_url).queue_depth == 0, SETTLE_S, "still queued after the client left")
        assert read_router_gauges(metrics_url).in_flight == 1  # the held request is running yet
    finally:
        held.cancel()
        channel.close()
        gateway.stop()


def test_calls_go_round_robin_over_two_routers(gw_stack, tmp_path):
    """`--router ipv4:a,b` (what a headless Service's DNS name resolves to: every router pod): each
    router process gets calls."""
    routers = []
    try:
        for _ in range(2):
            metrics = free_port()
            popen, port = start_router(gw_stack, "--metrics-port", str(metrics))
            routers.append((popen, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics}/metrics"))
        for _, target, _ in routers:
            until(lambda t=target: health_status(t, "omni.v1.Omni") == "SERVING", 60, "router not ready")
        gateway = start_gateway("ipv4:" + ",".join(target for _, target, _ in routers), tmp_path)
        try:
            client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)
            for _ in range(6):
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        finally:
            gateway.stop()
        served = [read_router_gauges(url).outcomes.get("ok", 0) for _, _, url in routers]
        assert sum(served) == 6 and min(served) >= 2, served
    finally:
        for popen, _, _ in routers:
            popen.terminate()
            popen.wait(timeout=20)


def status_of(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_with_tokens_every_route_but_the_probes_needs_one(gw_stack, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# callers\n{TOKEN}\n")
    metrics_port = free_port()
    gateway = start_gateway(gw_stack.target, tmp_path, "--auth-token-file", str(tokens), "--require-auth",
                            "--metrics-port", str(metrics_port))
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gateway.base_url, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=gateway.base_url, api_key=TOKEN, max_retries=0, timeout=60)
        assert ok.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1).usage.completion_tokens == 1
        for path in ("/metrics", "/v1/models", "/v1/chat/completions"):
            assert status_of(gateway.url + path) == 401, path
        assert status_of(gateway.url + "/metrics", TOKEN) == 200
        assert status_of(f"http://127.0.0.1:{metrics_port}/metrics") == 401
        assert status_of(f"http://127.0.0.1:{metrics_port}/metrics", TOKEN) == 200
        assert status_of(gateway.url + "/live") == 200 and status_of(gateway.url + "/health") == 200
    finally:
        gateway.stop()


def test_require_auth_without_tokens_refuses_to_start(gw_stack, tmp_path):
    with pytest.raises(RuntimeError, match="--require-auth"):
        start_gateway(gw_stack.target, tmp_path, "--require-auth", timeout_s=30)
