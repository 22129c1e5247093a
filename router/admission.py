"""Admission control: a bound on requests in flight and on the queue behind it.

A request either gets an in-flight place at once, or waits in a FIFO queue of bounded length
for at most `queue_timeout_s`. A full queue or an expired wait is refused at once
(RESOURCE_EXHAUSTED, before any response message) so that clients can retry elsewhere.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass


class Rejected(Exception):
    """The router is over capacity; the message says which bound was hit."""


@dataclass(frozen=True)
class AdmissionConfig:
    max_in_flight: int = 64  # requests streaming through the stages at once
    max_queue: int = 128  # requests waiting for an in-flight place
    queue_timeout_s: float = 10.0  # longest wait for a place
    retry_after_s: float = 1.0  # RetryInfo on a rejection: when a client may try again


class Admission:
    def __init__(self, config: AdmissionConfig):
        self.config = config
        self.in_flight = 0
        self.peak = 0  # the most in flight at once since the start (omni_router_in_flight_peak)
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.in_flight < self.config.max_in_flight and not self._waiters:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            return
        if len(self._waiters) >= self.config.max_queue:
            raise Rejected(f"router at capacity: {self.in_flight} in flight, queue of {self.config.max_queue} full")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.config.queue_timeout_s)
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # granted just as the wait expired: keep the place
            waiter.cancel()
            raise Rejected(f"router at capacity: no place within {self.config.queue_timeout_s:g} s") from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted, but the caller went away
            else:
                waiter.cancel()
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self) -> None:
        # Hand the place straight to the oldest live waiter, or give it back.
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.in_flight -= 1
