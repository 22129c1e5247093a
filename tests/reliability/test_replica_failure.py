"""A talker replica killed (-9) under load: its requests move to the other replica and complete
(tests/migration checks their audio equals the fault-free run), new requests go to the survivor,
and the restarted replica is used again."""

from __future__ import annotations

import threading
import time

import pytest

from services.tools.client import build_request
from services.tools.soak import Call, read_load

from .support import MAX_IN_FLIGHT, assert_recovered

pytestmark = pytest.mark.slow  # a stack of two talkers, one killed under load (about 20 s): make test-slow


def router_view(stack) -> dict[str, float]:
    """The router's count of requests it sent to each talker, and its view of their health."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(stack.metrics_url, timeout=5).read().decode()
    return {f"{s.name}{{{s.labels.get('replica', '')}}}": s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.labels.get("stage") == "talker"}


def start_all(calls: list[Call]) -> list[threading.Thread]:
    threads = [threading.Thread(target=call.run, daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    return threads


def wait_streaming_audio(calls: list[Call], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(call.audios >= 1 for call in calls):
        ended = [(call.code, call.details) for call in calls if call.done.is_set()]
        assert not ended, f"a request ended before the kill: {ended}"
        assert time.monotonic() < deadline, "requests never reached audio"
        time.sleep(0.01)


def test_a_killed_talker_s_requests_move_to_the_survivor_which_takes_new_ones(stack, omni):
    # 400 codec frames: several seconds of streaming, long after the kill, and long enough that the
    # first request is still streaming when the last starts (the start skew of 4 on a loaded 2-core
    # machine outlasted 200 frames once in a stress-ng run).
    calls = [Call(omni.Generate, build_request(f"under load {i}", max_new_tokens=8, talker_max_new_tokens=400), 120)
             for i in range(MAX_IN_FLIGHT)]
    threads = start_all(calls)
    wait_streaming_audio(calls)
    loads = {name: read_load("talker", stack.address(name)).in_flight for name in ("talker-0", "talker-1")}
    # The victim is the talker holding the most (the router balances, but under load two requests
    # arriving together can both see the other replica busier for a poll): its requests move.
    victim_name = max(loads, key=loads.get)
    survivor_name = next(name for name in loads if name != victim_name)
    on_victim, on_survivor = loads[victim_name], loads[survivor_name]
    assert on_victim >= 1 and on_victim + on_survivor == len(calls), (
        loads, {name: read_load("talker", stack.address(name)) for name in loads}, router_view(stack))

    stack.kill(victim_name)
    for thread in threads:
        thread.join(timeout=120)
    assert [call.code.name for call in calls] == ["OK"] * len(calls), [(c.code, c.details) for c in calls]
    assert all(call.final.usage.codec_frames == 399 for call in calls)
    assert sorted(call.final.migrations for call in calls) == [0] * on_survivor + [1] * on_victim

    # New requests: only the survivor is left, and the router knows it.
    fresh = [Call(omni.Generate, build_request(f"after the kill {i}", max_new_tokens=4, talker_max_new_tokens=20), 60)
             for i in range(MAX_IN_FLIGHT)]
    for thread in start_all(fresh):
        thread.join(timeout=60)
    assert [call.code.name for call in fresh] == ["OK"] * len(fresh), [(c.code, c.details) for c in fresh]

    # Restarted on its address, the replica is picked again.
    stack.restart(victim_name)
    seen_after = stack.wait_router_sees(victim_name, True, timeout_s=60.0)
    print(f"router used the restarted {victim_name} {seen_after:.2f} s after it reported SERVING")
    probes = [Call(omni.Generate, build_request(f"back {i}", max_new_tokens=4, talker_max_new_tokens=60), 60)
              for i in range(MAX_IN_FLIGHT)]
    # Streams each talker opened, counted by the talker itself (no poll of a short in-flight window).
    before = {name: read_load("talker", stack.address(name)).streams_total for name in (victim_name, survivor_name)}
    for thread in start_all(probes):
        thread.join(timeout=60)
    assert [call.code.name for call in probes] == ["OK"] * len(probes), [(c.code, c.details) for c in probes]
    took = {name: read_load("talker", stack.address(name)).streams_total - before[name] for name in before}
    assert sum(took.values()) == len(probes), took
    assert took[victim_name] >= 1, f"the router never sent work to the restarted {victim_name}: {took}"
    assert_recovered(stack, omni)
