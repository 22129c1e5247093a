"""Client cancellations at random points and deadlines that pass mid-stream free the request's
place in the router and its slots in every stage."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait

from services.tools.client import build_request
from services.tools.soak import Call, CancelPoint, CancelWhen, read_router_gauges

from .support import MAX_IN_FLIGHT, assert_recovered

SEED = 20240611
TEXT_TOKENS = 8


def random_cancellations(rng: random.Random, omni, count: int) -> list[Call]:
    """Long requests (200 codec frames, or 200 text tokens), each cancelled at a random point."""
    calls = []
    for i in range(count):
        when = rng.choice(list(CancelWhen))
        text_only = when is not CancelWhen.AFTER_AUDIO and rng.random() < 0.3
        count_at = rng.randint(1, TEXT_TOKENS - 1) if when is CancelWhen.AFTER_TEXT else rng.randint(1, 3)
        point = CancelPoint(when, count_at, delay_s=rng.uniform(0.0, 0.05))
        if text_only:  # 200 tokens: ~0.4 s, still running at any of the points
            request = build_request(f"cancel me {i}", text_only=True, max_new_tokens=200)
        else:
            request = build_request(f"cancel me {i}", max_new_tokens=TEXT_TOKENS, talker_max_new_tokens=200)
        calls.append(Call(omni.Generate, request, 60, point))
    return calls


def test_random_cancellations_free_every_stage(stack, omni):
    calls = random_cancellations(random.Random(SEED), omni, 16)
    points = Counter(call.cancel_at.when for call in calls)
    assert set(points) == set(CancelWhen), points  # the seed covers every kind of point
    with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        _, hanging = wait([pool.submit(call.run) for call in calls], timeout=120)
    assert not hanging
    for call in calls:
        assert call.code.name == "CANCELLED", (call.cancel_at, call.code, call.details)
        if call.cancel_at.when is CancelWhen.AFTER_AUDIO:
            assert call.audios >= call.cancel_at.count and call.final is None
    assert_recovered(stack, omni)


def test_cancelled_while_queued_gives_back_the_queue_place(stack, omni):
    holders = [Call(omni.Generate, build_request(f"hold {i}", max_new_tokens=8, talker_max_new_tokens=2000), 120)
               for i in range(MAX_IN_FLIGHT)]
    queued = [Call(omni.Generate, build_request(f"queued {i}", max_new_tokens=4, talker_max_new_tokens=8), 60)
              for i in range(2)]

    def wait_router(in_flight: int, queue_depth: int) -> None:
        deadline = time.monotonic() + 30
        while True:
            gauges = read_router_gauges(stack.metrics_url)
            if (gauges.in_flight, gauges.queue_depth) == (in_flight, queue_depth):
                return
            assert time.monotonic() < deadline, (gauges.in_flight, gauges.queue_depth)
            time.sleep(0.02)

    for call in holders:
        threading.Thread(target=call.run, daemon=True).start()
    wait_router(MAX_IN_FLIGHT, 0)
    for call in queued:
        threading.Thread(target=call.run, daemon=True).start()
    wait_router(MAX_IN_FLIGHT, len(queued))
    for call in queued:
        call.cancel()
        assert call.done.wait(5) and call.code.name == "CANCELLED" and call.messages == 0
    wait_router(MAX_IN_FLIGHT, 0)  # the holders keep their places; the queue is empty again
    for call in holders:
        call.cancel()
        assert call.done.wait(10) and call.code.name == "CANCELLED", (call.code, call.details)
    assert_recovered(stack, omni)


def test_deadlines_passing_mid_stream_end_with_deadline_exceeded_and_free_every_stage(stack, omni):
    # The deadline must pass after the first messages and long before the requests end: a
    # multiple of the first-message time measured now (0.6 s at least), not a fixed window, which a
    # loaded machine can outlast before anything streams.
    probe = Call(omni.Generate, build_request("how fast", max_new_tokens=2, talker_max_new_tokens=8), 60).run()
    assert probe.code.name == "OK", (probe.code, probe.details)
    deadline_s = max(0.6, 4 * (probe.first_message - probe.started))
    calls = [Call(omni.Generate, build_request(f"too slow {i}", max_new_tokens=8, talker_max_new_tokens=400), deadline_s)
             for i in range(3)]
    calls.append(Call(omni.Generate, build_request("long text", text_only=True, max_new_tokens=2000), deadline_s))
    before = read_router_gauges(stack.metrics_url).outcomes
    with ThreadPoolExecutor(len(calls)) as pool:
        _, hanging = wait([pool.submit(call.run) for call in calls], timeout=30)
    assert not hanging
    for call in calls:
        assert call.code.name == "DEADLINE_EXCEEDED", (call.code, call.details)
        assert call.seconds >= deadline_s - 0.01, call.seconds  # the deadline ended it, not something earlier
    assert any(call.messages for call in calls), "no deadline passed mid-stream"
    # The client's own timer ends the call (what the stages do about it: test_aborts_stop_work).
    # That the router let go of each one is counted where it happens: the router's outcome counter
    # (incremented as its handler ends, which frees the admission place) counts every one of them as
    # ended by the deadline or the cancel it becomes, and then nothing is held anywhere
    # (assert_recovered). No wall-clock bound, which a loaded machine can outlast.
    deadline = time.monotonic() + 30
    while True:
        outcomes = read_router_gauges(stack.metrics_url).outcomes
        ended = {k: n - before.get(k, 0) for k, n in outcomes.items() if n != before.get(k, 0)}
        if sum(ended.values()) >= len(calls):
            break
        assert time.monotonic() < deadline, f"the router still holds some of the {len(calls)} expired requests: {ended}"
        time.sleep(0.05)
    assert sum(ended.values()) == len(calls) and set(ended) <= {"deadline_exceeded", "cancelled"}, ended
    assert_recovered(stack, omni)


def test_cancelling_one_of_several_requests_sharing_a_request_id_leaves_the_others_running(stack, omni):
    shared = "same-id"
    keep = [Call(omni.Generate, build_request(f"keep {i}", max_new_tokens=6, talker_max_new_tokens=60,
                                              request_id=shared), 60) for i in range(2)]
    cancel = Call(omni.Generate, build_request("drop", max_new_tokens=6, talker_max_new_tokens=200, request_id=shared),
                  60, CancelPoint(CancelWhen.AFTER_AUDIO, 1))
    threads = [threading.Thread(target=call.run, daemon=True) for call in (*keep, cancel)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert cancel.code.name == "CANCELLED", (cancel.code, cancel.details)
    for call in keep:
        assert call.code.name == "OK", (call.code, call.details)
        assert call.texts == 6 and call.final.usage.codec_frames == 59
    assert_recovered(stack, omni)
