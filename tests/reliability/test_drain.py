"""SIGTERM drains a replica: it turns NOT_SERVING, its in-flight stream completes normally, the
process exits within its grace period, and new requests go to the other replica."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.tools.client import build_request
from services.tools.launcher import health_status
from services.tools.soak import Call, read_load

from .support import TALKER_GRACE_S, assert_recovered

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REPO = Path(__file__).resolve().parents[2]


class HealthWatch:
    """A grpc.health.v1 Watch stream on one replica, opened now, recording every status it gets."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.statuses: list[int] = []
        self._call = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self.statuses.append(response.status)
        except grpc.RpcError:
            pass

    def wait_for(self, status: int, timeout_s: float) -> float:
        start = time.monotonic()
        while status not in self.statuses:
            assert time.monotonic() - start < timeout_s, f"watch saw {self.statuses}, not {status}"
            time.sleep(0.01)
        return time.monotonic() - start

    def close(self) -> None:
        # An open Watch is an in-flight call too: it would hold the server's drain to the full grace.
        self._call.cancel()
        self.channel.close()


def test_sigterm_drains_a_talker_its_stream_completes_it_exits_and_new_requests_go_elsewhere(stack, omni):
    # 300 codec frames: streaming for seconds after the SIGTERM.
    long = Call(omni.Generate, build_request("drain me", max_new_tokens=8, talker_max_new_tokens=300), 120)
    threading.Thread(target=long.run, daemon=True).start()
    deadline = time.monotonic() + 60
    while long.audios < 1:
        assert time.monotonic() < deadline and not long.done.is_set(), (long.code, long.details)
        time.sleep(0.01)
    loads = {name: read_load("talker", stack.address(name)).in_flight for name in ("talker-0", "talker-1")}
    victim = max(loads, key=loads.get)
    other = "talker-1" if victim == "talker-0" else "talker-0"
    assert loads == {victim: 1, other: 0}, loads
    watch = HealthWatch(stack.address(victim))
    watch.wait_for(SERVING, timeout_s=5)

    terminated = stack.kill(victim, signal.SIGTERM)
    try:
        not_serving_after = watch.wait_for(NOT_SERVING, timeout_s=2)
    finally:
        watch.close()
    # A health check on a new connection still gets NOT_SERVING during the drain delay.
    assert health_status(stack.address(victim)) == "NOT_SERVING"
    router_after = stack.wait_router_sees(victim, False, timeout_s=3)

    fresh = [Call(omni.Generate, build_request(f"while draining {i}", max_new_tokens=4, talker_max_new_tokens=20), 60)
             for i in range(3)]
    threads = [threading.Thread(target=call.run, daemon=True) for call in fresh]
    # Counted by the other talker itself (every stream it opened), not by polls of a short window.
    other_before = read_load("talker", stack.address(other)).streams_total
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert [call.code.name for call in fresh] == ["OK"] * len(fresh), [(c.code, c.details) for c in fresh]
    on_other = read_load("talker", stack.address(other)).streams_total - other_before
    assert on_other == len(fresh), f"{on_other} of the {len(fresh)} new requests went to {other}"

    assert long.done.wait(TALKER_GRACE_S + 10)
    assert long.code.name == "OK", (long.code, long.details)
    assert long.final is not None and long.final.usage.codec_frames == 299
    exit_code = stack.popen(victim).wait(timeout=TALKER_GRACE_S + 10)
    exited = time.perf_counter()
    assert exit_code == 0
    assert exited - terminated < TALKER_GRACE_S, f"exited {exited - terminated:.1f} s after SIGTERM"
    print(f"drain: NOT_SERVING on the watch {not_serving_after * 1000:.0f} ms after SIGTERM, router skipped it "
          f"after {router_after * 1000:.0f} ms; stream completed {long.ended - terminated:.2f} s and process "
          f"exited {exited - terminated:.2f} s after SIGTERM")
    assert_recovered(stack, omni)


SLOW_SERVER = """
import asyncio, grpc
from services.serving.grpc_server import build_server, serve_until_signal

async def slow(request, context):
    for _ in range(600):
        await asyncio.sleep(0.05)
        yield b"x"

async def main():
    handle = build_server("127.0.0.1", 0, ())
    handle.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Slow", {"Stream": grpc.unary_stream_rpc_method_handler(slow)}),))
    print(handle.port, flush=True)
    await serve_until_signal(handle, grace_s=10)

asyncio.run(main())
"""


def test_a_draining_service_still_answers_health_checks_with_not_serving():
    server = subprocess.Popen([sys.executable, "-c", SLOW_SERVER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{int(server.stdout.readline())}"
        with grpc.insecure_channel(address) as channel:
            stream = channel.unary_stream("/test.Slow/Stream")(b"", timeout=30)
            next(stream)  # a call in flight keeps the server draining
            server.send_signal(signal.SIGTERM)
            # Health answers on new connections throughout the drain: NOT_SERVING comes while the
            # call is still open and the process still running (its grace is 10 s).
            deadline = time.monotonic() + 5
            while (status := health_status(address)) != "NOT_SERVING" and time.monotonic() < deadline:
                time.sleep(0.02)
            draining = server.poll() is None
            stream.cancel()
        assert status == "NOT_SERVING"
        assert draining, "the server exited instead of draining"
    finally:
        server.kill()
        server.wait(timeout=10)
