"""The closed load loop every benchmark here uses: N clients, each sending its next request as soon
as its previous one ended (stdlib only, so the device check can use it too)."""

from __future__ import annotations

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
