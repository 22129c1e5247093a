"""Event-loop lag: how late the loop runs a timer, which is how long every handler on it waited
behind whatever held it (a long synchronous call, a burst of work). Observed into a histogram every
`period_s` by a task on the loop itself; the router and the sessions service export theirs."""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

PERIOD_S = 0.1
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


async def watch(histogram: Histogram, period_s: float = PERIOD_S) -> None:
    """Forever: sleep `period_s`, observe how much later than due the loop woke this task."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period_s
        await asyncio.sleep(period_s)
        histogram.observe(max(loop.time() - due, 0.0))
