"""The load loops the benchmarks use (stdlib only, so the device check can use them too): the
closed loop, N clients each sending its next request as soon as its previous one ended; and the
open loop, requests sent at seeded Poisson arrival times whatever is in flight."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def closed_loop(items: list[Item], concurrency: int, call: Callable[[Item], Result],
                failed: Callable[[Exception], Result],
                on_done: Callable[[Result], None] = lambda _: None) -> tuple[list[Result], float]:
    """Results in the order of `items` (`failed(exc)` for a call that raised), and the wall time
    from the first send to the last completion."""
    results: list = [None] * len(items)
    pending = list(range(len(items)))[::-1]  # popped from the end: item 0 first
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                index = pending.pop()
            try:
                result = call(items[index])
            except Exception as exc:  # one failed request must not end the run
                result = failed(exc)
            results[index] = result
            on_done(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(items)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - start


def closed_loop_requests(concurrency: int, per_client: int, minimum: int = 0) -> int:
    """Requests a closed-loop level at `concurrency` sends: `per_client` for each client, `minimum`
    at least. Three a client keeps `concurrency` in flight for the middle third while the first and
    last thirds fill and drain the batch, so a level is more than one simultaneous burst."""
    return max(per_client * concurrency, minimum)


def arrival_times(count: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Send times in seconds from the start of an open loop: a Poisson process of `rate_per_s`
    (exponential gaps, seeded, so two runs offer the same arrivals), the first at 0."""
    if rate_per_s <= 0:
        raise ValueError(f"an open loop's rate must be above 0, got {rate_per_s}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


def open_loop(items: list[Item], rate_per_s: float, call: Callable[[Item], Result],
              failed: Callable[[Exception], Result], seed: int = 0) -> tuple[list[Result], float]:
    """Each item sent at its arrival time (`arrival_times`) on a thread of its own, whatever is
    still in flight: the offered load does not wait for the system, so a queue that grows shows in
    the latencies. Results in the order of `items`, and the wall time from the first send to the
    last completion."""
    results: list = [None] * len(items)

    def send(index: int) -> None:
        try:
            results[index] = call(items[index])
        except Exception as exc:  # one failed request must not end the run
            results[index] = failed(exc)

    start = time.perf_counter()
    threads = []
    for index, at in enumerate(arrival_times(len(items), rate_per_s, seed)):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        thread = threading.Thread(target=send, args=(index,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - start
