"""The stage's view of its streams and the router's view of its replicas: every open stream
counts as in flight, a slow replica is suspect but kept, a refused one is down at once, and a
client cancelling mid-stream is a normal end (no tracebacks in any log)."""

from __future__ import annotations

import random
import signal
import threading
import time

import grpc

from omni.v1 import common_pb2, stages_pb2_grpc
from services.tools.client import build_request
from services.tools.soak import Call, CancelPoint, CancelWhen, wait_settled

from .support import MAX_IN_FLIGHT, POLL_DEADLINE_S, SETTLE_S


def thinker_in_flight(stack) -> int:
    with grpc.insecure_channel(stack.address("thinker-0")) as channel:
        return stages_pb2_grpc.ThinkerStub(channel).GetLoad(common_pb2.LoadRequest(), timeout=5).in_flight


def test_every_open_stream_counts_as_in_flight_after_its_text_is_done(stack, omni):
    """Four streams whose text is done and whose audio is still coming (the client reads slowly):
    the thinker's engine holds none of them, the thinker still has four streams open."""
    calls = [omni.Generate(build_request(f"slow reader {i}", max_new_tokens=2, talker_max_new_tokens=400), timeout=120)
             for i in range(4)]
    for call in calls:  # read until the text is done and the first audio came: the thinker relays the rest
        texts = audio = 0
        while texts < 2 or not audio:
            response = next(call)
            kind = response.WhichOneof("event")
            texts += len(response.text.token_ids) if kind == "text" else 0
            audio += kind == "audio"
    assert thinker_in_flight(stack) == 4
    for call in calls:
        call.cancel()
    settled = wait_settled(stack.replicas, stack.metrics_url, SETTLE_S)
    assert settled.idle, settled.busy()


def router_samples(stack) -> dict[tuple[str, str, str, str], float]:
    """(metric, stage, replica, state) -> value of the router's per-replica metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(stack.metrics_url, timeout=2).read().decode()
    return {(sample.name, sample.labels["stage"], sample.labels["replica"], sample.labels.get("state", "")): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if "replica" in sample.labels and "stage" in sample.labels}


def replica_state(stack, stage: str, name: str) -> str:
    address = stack.address(name)
    for (metric, s, replica, state), v in router_samples(stack).items():
        if metric == "omni_router_replica_state" and (s, replica) == (stage, address) and v == 1.0:
            return state
    return "unknown"


def replica_counts(stack, stage: str, name: str) -> tuple[int, int]:
    """The router's own totals for one replica since it started: polls past their deadline, times down."""
    samples, address = router_samples(stack), stack.address(name)
    return (int(samples.get(("omni_router_replica_missed_polls", stage, address, ""), 0)),
            int(samples.get(("omni_router_replica_downs", stage, address, ""), 0)))


def test_a_replica_that_misses_polls_is_suspect_not_dropped(stack, omni):
    """code2wav, the only replica, stops answering (SIGSTOP) until the router has counted a poll of
    it that ran past its deadline (suspect), while requests keep coming; then it continues. By the
    router's own totals (counted in each poll, not sampled): a missed poll and no time down; and no
    request is refused for want of a replica. No window is timed: the pause lasts until the miss."""
    popen = stack.popen("code2wav-0")
    calls = []
    stop = threading.Event()
    missed_before, downs_before = replica_counts(stack, "code2wav", "code2wav-0")

    def send() -> None:
        i = 0
        while not stop.is_set():
            call = Call(omni.Generate, build_request(f"during the pause {i}", max_new_tokens=2,
                                                     talker_max_new_tokens=8), 120)
            calls.append(call)
            threading.Thread(target=call.run, daemon=True).start()
            i += 1
            time.sleep(0.1)

    sender = threading.Thread(target=send, daemon=True)
    popen.send_signal(signal.SIGSTOP)
    try:
        sender.start()
        deadline = time.monotonic() + 60
        while replica_counts(stack, "code2wav", "code2wav-0")[0] == missed_before:
            assert time.monotonic() < deadline, "the router never counted a missed poll of the stopped replica"
            time.sleep(0.05)
    finally:
        popen.send_signal(signal.SIGCONT)
    stop.set()
    sender.join()
    for call in calls:
        assert call.done.wait(120)
    codes = [(c.code, c.details) for c in calls if c.code is not grpc.StatusCode.OK]
    assert not codes, codes[:5]
    deadline = time.monotonic() + 30
    while replica_state(stack, "code2wav", "code2wav-0") != "up":  # published after its next answered poll
        assert time.monotonic() < deadline, replica_state(stack, "code2wav", "code2wav-0")
        time.sleep(0.05)
    missed, downs = replica_counts(stack, "code2wav", "code2wav-0")
    assert missed > missed_before and downs == downs_before, (missed_before, missed, downs_before, downs)
    settled = wait_settled(stack.replicas, stack.metrics_url, SETTLE_S)
    assert settled.idle, settled.busy()


def test_a_refused_connection_marks_the_replica_down_at_once(stack, omni):
    popen = stack.popen("code2wav-0")
    popen.kill()
    popen.wait()
    stack.wait_router_sees("code2wav-0", False, timeout_s=5 * POLL_DEADLINE_S)
    assert replica_state(stack, "code2wav", "code2wav-0") == "down"
    stack.restart("code2wav-0")
    stack.wait_router_sees("code2wav-0", True, timeout_s=30)
    assert replica_state(stack, "code2wav", "code2wav-0") == "up"


def test_cancelling_mid_stream_logs_no_traceback(stack, omni):
    rng = random.Random(14)
    for process in stack.stack.processes.values():
        process.output.clear()
    calls = []
    for i in range(96):
        when = rng.choice([CancelWhen.AFTER_TEXT, CancelWhen.AFTER_AUDIO, CancelWhen.AFTER_AUDIO, CancelWhen.BEFORE_FIRST])
        calls.append(Call(omni.Generate, build_request(f"cancel {i}", max_new_tokens=6, talker_max_new_tokens=100), 60,
                          CancelPoint(when, rng.randint(1, 3), delay_s=rng.uniform(0, 0.05))))
    threads = [threading.Thread(target=call.run, daemon=True) for call in calls]
    for k in range(0, len(threads), MAX_IN_FLIGHT):
        batch = threads[k:k + MAX_IN_FLIGHT]
        for thread in batch:
            thread.start()
        for thread in batch:
            thread.join(60)
    assert all(call.code is grpc.StatusCode.CANCELLED for call in calls), {c.code for c in calls}
    # Clients that stop reading mid-audio (flow control holds the stages' sends), then cancel: every
    # stage's pending send fails in gRPC core.
    stalled = [omni.Generate(build_request(f"stalled {i}", max_new_tokens=2, talker_max_new_tokens=400), timeout=120)
               for i in range(4)]
    for call in stalled:
        while next(call).WhichOneof("event") != "audio":
            pass
    time.sleep(1.0)  # the stages fill the flow-control windows and block in a send
    for call in stalled:
        call.cancel()
    settled = wait_settled(stack.replicas, stack.metrics_url, SETTLE_S)
    assert settled.idle, settled.busy()
    time.sleep(0.5)  # let the last log lines arrive
    for name, process in stack.stack.processes.items():
        noisy = [line for line in list(process.output) if "Traceback" in line or "ExecuteBatchError" in line or " ERROR " in line]
        assert not noisy, (name, noisy[:5])
