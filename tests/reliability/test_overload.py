"""Overload: offered several times its capacity, the router completes or refuses every request at
once (RESOURCE_EXHAUSTED before any response message), never lets more than its limit through to
the stages, and nothing hangs.

"Never more than the limit" rests on high-water marks kept where the requests are counted: the
router's admission (`omni_router_in_flight_peak`) and the thinker's open streams
(`LoadReport.in_flight_peak`, reset just before the burst), not on polls that can miss a spike."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait

from services.tools.client import build_request
from services.tools.soak import Call, read_load, read_router_gauges

from .support import MAX_IN_FLIGHT, MAX_QUEUE, QUEUE_TIMEOUT_S, assert_recovered

OFFERED = 30  # requests at once: 30 against 4 in flight + 4 queued
# Long enough that the fastest admitted request ends well after the last refusal on arrival, whose
# time on a loaded host is mostly the client's 30 threads waiting their turn (40 frames once gave
# 423 ms against a 487 ms refusal, with the suite's two workers and a CPU hog on 2 cores).
TALKER_MAX_NEW_TOKENS = 120


def test_several_times_capacity_completes_or_is_rejected_before_any_message_and_nothing_hangs(stack, omni):
    calls = [Call(omni.Generate, build_request(f"overload {i}", max_new_tokens=8,
                                                talker_max_new_tokens=TALKER_MAX_NEW_TOKENS), 60)
             for i in range(OFFERED)]
    start = threading.Barrier(OFFERED)
    thinker = stack.address("thinker-0")
    read_load("thinker", thinker, reset_peak=True)  # the thinker's mark starts with this burst

    def run_together(call: Call) -> Call:
        start.wait(timeout=30)
        return call.run()

    with ThreadPoolExecutor(OFFERED) as pool:
        futures = [pool.submit(run_together, call) for call in calls]
        _, hanging = wait(futures, timeout=120)
    assert not hanging, f"{len(hanging)} of {OFFERED} requests never ended"

    codes = Counter(call.code.name for call in calls)
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, [(c.code, c.details) for c in calls if c.code.name != "OK"]
    completed, rejected = codes["OK"], codes["RESOURCE_EXHAUSTED"]
    assert completed + rejected == OFFERED
    assert completed >= MAX_IN_FLIGHT, codes
    # At the instant 30 arrive only 4 + 4 fit; some queued ones may still get a place in time.
    done = [call for call in calls if call.code.name == "OK"]
    full = [call for call in calls if "full" in call.details]  # the queue was full on arrival
    timed_out = [call for call in calls if "no place within" in call.details]  # queued, then waited out
    assert len(full) + len(timed_out) == rejected, [c.details for c in calls if c.code.name != "OK"]
    assert len(full) >= OFFERED - 2 * (MAX_IN_FLIGHT + MAX_QUEUE), codes
    for call in done:
        assert call.final is not None and call.final.usage.codec_frames == TALKER_MAX_NEW_TOKENS - 1
    for call in full + timed_out:
        assert call.messages == 0, "a rejection must come before any response message"
    # A full queue refuses at once: before the fastest admitted request could have finished (an
    # ordering of events measured in this run, so a loaded machine slows both sides alike).
    fastest = min(call.seconds for call in done)
    slowest_full = max(call.seconds for call in full)
    assert slowest_full < fastest, (slowest_full, fastest)
    # A queued request waits out its queue wait, not longer.
    for call in timed_out:
        assert QUEUE_TIMEOUT_S - 0.1 <= call.seconds < QUEUE_TIMEOUT_S + 1.5, call.seconds
    # The router's mark covers its whole life (it can never pass the limit); the burst reached it.
    router_peak = read_router_gauges(stack.metrics_url).in_flight_peak
    thinker_peak = read_load("thinker", thinker, reset_peak=True).in_flight_peak
    assert router_peak == MAX_IN_FLIGHT, f"router admitted {router_peak} at once (limit {MAX_IN_FLIGHT})"
    assert 1 <= thinker_peak <= MAX_IN_FLIGHT, f"the thinker had {thinker_peak} streams open at once"
    print(f"overload: {completed} completed (fastest {fastest * 1e3:.0f} ms), {len(full)} refused on arrival "
          f"(median {sorted(c.seconds for c in full)[len(full) // 2] * 1e3:.1f} ms, slowest "
          f"{slowest_full * 1e3:.1f} ms), {len(timed_out)} after the queue wait; "
          f"peak in flight router {router_peak} / thinker {thinker_peak}")
    assert_recovered(stack, omni)


def test_a_queued_request_is_rejected_once_its_queue_wait_passes(stack, omni):
    # Long requests hold every place; they are cancelled at the end.
    holders = [Call(omni.Generate, build_request(f"hold {i}", max_new_tokens=8, talker_max_new_tokens=2000), 120)
               for i in range(MAX_IN_FLIGHT)]
    for call in holders:
        threading.Thread(target=call.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while read_router_gauges(stack.metrics_url).in_flight < MAX_IN_FLIGHT:
        assert time.monotonic() < deadline and not any(c.done.is_set() for c in holders), \
            [(c.code, c.details) for c in holders]
        time.sleep(0.05)

    waiting = Call(omni.Generate, build_request("no room", max_new_tokens=4, talker_max_new_tokens=8), 60).run()
    assert waiting.code.name == "RESOURCE_EXHAUSTED" and waiting.messages == 0, (waiting.code, waiting.details)
    assert f"no place within {QUEUE_TIMEOUT_S:g} s" in waiting.details, waiting.details
    assert QUEUE_TIMEOUT_S - 0.1 <= waiting.seconds < QUEUE_TIMEOUT_S + 1.5, waiting.seconds

    for call in holders:
        call.cancel()
    for call in holders:
        assert call.done.wait(10)
        assert call.code.name == "CANCELLED", (call.code, call.details)
    assert_recovered(stack, omni)
