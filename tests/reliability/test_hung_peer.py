"""A hung peer: a stage replica stopped with SIGSTOP (its sockets stay open, nothing answers).

Its requests must end within the stages' stream idle timeout with UNAVAILABLE, the router's
readiness (grpc.health.v1 for omni.v1.Omni) must go NOT_SERVING while that stage has no healthy
replica and SERVING again after SIGCONT, and the stack must then serve normally with nothing left
in flight. The stack is this module's own: a short --stream-idle-timeout-s on every stage, one
replica each, so a stopped replica leaves its stage with none.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from services.serving.status import error_info
from services.tools.client import build_request, collect, connect
from services.tools.launcher import free_port, health_status
from services.tools.soak import Call, read_loads
from tests.stacks import stack_of

# slow: a stack of its own (the short idle timeout on every stage) and streams left to time out:
# ~70 s of make test's 2 cores; make test-slow (CI) runs it.
pytestmark = pytest.mark.slow

IDLE_TIMEOUT_S = 3.0
WAIT_S = 60.0  # how long a step may take before the test calls it a hang (generous: a loaded machine)


@pytest.fixture(scope="module")
def hung(tiny_checkpoint):
    idle = ("--stream-idle-timeout-s", str(IDLE_TIMEOUT_S))
    metrics_port = free_port()
    with stack_of(tiny_checkpoint, thinker_args=idle, talker_args=idle, code2wav_args=idle,
                  router_args=("--metrics-port", str(metrics_port), *idle)) as stack:
        channel, stub = connect(stack.target)
        with channel:
            yield stack, stub


def readiness(stack) -> str:
    return health_status(stack.target, "omni.v1.Omni")


def wait_for(predicate, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < WAIT_S, f"{what}: not within {WAIT_S} s"
        time.sleep(0.05)
    return time.monotonic() - start


def replicas(stack) -> dict[str, tuple[str, ...]]:
    return {stage: tuple(stack.addresses(stage)) for stage in ("thinker", "talker", "code2wav")}


@pytest.mark.parametrize("stopped", ["code2wav-0", "talker-0", "thinker-0"])
def test_a_stopped_stage_ends_its_requests_unavailable_and_readiness_follows_it(hung, stopped):
    stack, omni = hung
    assert readiness(stack) == "SERVING"
    call = Call(omni.Generate, build_request("keep talking", max_new_tokens=8, talker_max_new_tokens=1500), 600)
    thread = threading.Thread(target=call.run, daemon=True)
    thread.start()
    wait_for(lambda: call.audios >= 1 or call.done.is_set(), "first audio")
    assert not call.done.is_set(), (call.code, call.details)
    stack.kill(stopped, signal.SIGSTOP)
    try:
        thread.join(WAIT_S)
        assert call.done.is_set(), "the request hangs with its peer"
        assert call.code.name == "UNAVAILABLE", (call.code, call.details)
        # Ended by the idle timeout, not by finishing its 1499 frames, naming the stage that hangs and
        # its replica: the stage calling it waits the idle timeout, the stages above it longer.
        assert call.final is None
        stage, address = stopped.split("-")[0], f"127.0.0.1:{stack.port(stopped)}"
        assert call.details.startswith(f"{stage} ({address}): no progress on this stream"), call.details
        info = error_info(call.error)
        assert info is not None and info.reason == "STREAM_IDLE", info
        assert (info.metadata["stage"], info.metadata["replica"]) == (stage, address), info
        wait_for(lambda: readiness(stack) == "NOT_SERVING", "router readiness NOT_SERVING")
    finally:
        stack.kill(stopped, signal.SIGCONT)
    wait_for(lambda: readiness(stack) == "SERVING", "router readiness SERVING again")
    # Continued: it serves, and nothing is left in flight anywhere.
    ok = Call(omni.Generate, build_request("back again", max_new_tokens=4, talker_max_new_tokens=8), 120).run()
    assert ok.code.name == "OK", (ok.code, ok.details)
    assert ok.texts == 4 and ok.final is not None and ok.final.usage.codec_frames == 7
    wait_for(lambda: all(load.idle for load in read_loads(replicas(stack))), "every stage idle")


@pytest.mark.parametrize("killed", ["code2wav-0", "thinker-0"])
def test_a_killed_code2wav_or_thinker_ends_its_requests_unavailable_naming_it(hung, killed):
    # The reliability suite kills only talkers; these are the other two stages.
    stack, omni = hung
    call = Call(omni.Generate, build_request("keep talking", max_new_tokens=8, talker_max_new_tokens=1500), 600)
    thread = threading.Thread(target=call.run, daemon=True)
    thread.start()
    wait_for(lambda: call.audios >= 1 or call.done.is_set(), "first audio")
    assert not call.done.is_set(), (call.code, call.details)
    stack.kill(killed)
    try:
        thread.join(WAIT_S)
        assert call.done.is_set(), "the request hangs with its dead peer"
        assert call.code.name == "UNAVAILABLE", (call.code, call.details)
        stage = killed.split("-")[0]
        assert stage in call.details, call.details
        wait_for(lambda: readiness(stack) == "NOT_SERVING", "router readiness NOT_SERVING")
        with pytest.raises(grpc.RpcError) as refused:
            collect(omni, build_request("anyone?", max_new_tokens=2, talker_max_new_tokens=3), timeout=60)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        info = error_info(refused.value)
        assert info is not None and info.metadata["stage"] == stage, (info, refused.value.details())
    finally:
        stack.processes[killed].popen.wait(timeout=30)
        stack.restart(killed)
    wait_for(lambda: readiness(stack) == "SERVING", "router readiness SERVING again")
    ok = Call(omni.Generate, build_request("back again", max_new_tokens=4, talker_max_new_tokens=8), 120).run()
    assert ok.code.name == "OK", (ok.code, ok.details)
    wait_for(lambda: all(load.idle for load in read_loads(replicas(stack))), "every stage idle")


@pytest.mark.exactness
def test_a_peer_stopped_briefly_resumes_and_the_stream_completes_unchanged(hung):
    # Stopped for a sixth of the idle timeout, then continued: the stream picks up where it was
    # and gives exactly what an undisturbed run gives.
    import numpy as np

    from services.tools.client import collect

    stack, omni = hung
    request = build_request("pause and go on", max_new_tokens=6, talker_max_new_tokens=120, return_codec_frames=True)
    undisturbed = collect(omni, request, timeout=120)
    first_audio = threading.Event()
    results = []
    thread = threading.Thread(target=lambda: results.append(collect(
        omni, request, timeout=120, on_event=lambda kind, _r, _res: kind == "audio" and first_audio.set())),
        daemon=True)
    thread.start()
    assert first_audio.wait(WAIT_S), "no audio"
    stack.kill("code2wav-0", signal.SIGSTOP)
    try:
        time.sleep(IDLE_TIMEOUT_S / 6)
    finally:
        stack.kill("code2wav-0", signal.SIGCONT)
    thread.join(WAIT_S)
    assert results, "the paused request failed or hangs"
    got = results[0]
    assert got.thinker_token_ids == undisturbed.thinker_token_ids
    assert got.codec_frames == undisturbed.codec_frames and len(got.codec_frames) == 119
    assert got.audio.shape == undisturbed.audio.shape
    np.testing.assert_allclose(got.audio, undisturbed.audio, rtol=0, atol=1e-6)
