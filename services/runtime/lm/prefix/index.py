"""What the router sees of a replica's pool: the message-prefix keys whose blocks it holds
(services/serving/prefix_keys.py, services/serving/prefix_routing.py)."""

from __future__ import annotations

import random
import threading
from collections import deque


class PrefixIndex:
    """The message-prefix keys whose blocks the cache holds, for the router: key -> tokens held.
    A key is held while the last block it needs is; changes are logged with a sequence number, so
    a poll gets what changed since its last one (`report`). Read from the gRPC thread, written from
    the engine's: one lock."""

    def __init__(self, log_size: int = 8192):
        self.epoch = random.getrandbits(63) or 1  # a new one each start: the router's view resets
        self._lock = threading.Lock()
        self._seq = 0
        self._held: dict[bytes, int] = {}  # message key -> tokens held
        self._by_block: dict[bytes, set[bytes]] = {}  # block key -> the message keys it ends
        self._log: deque[tuple[int, bytes, int]] = deque(maxlen=log_size)  # (seq, key, tokens; 0: gone)

    def add(self, message_key: bytes, last_block: bytes, tokens: int) -> None:
        """`message_key`'s whole blocks are all in the pool now, `tokens` of them, the last `last_block`."""
        with self._lock:
            if self._held.get(message_key) == tokens:
                return
            self._held[message_key] = tokens
            self._by_block.setdefault(last_block, set()).add(message_key)
            self._append(message_key, tokens)

    def evicted(self, block_key: bytes) -> None:
        with self._lock:
            for message_key in self._by_block.pop(block_key, ()):
                if self._held.pop(message_key, None) is not None:
                    self._append(message_key, 0)

    def _append(self, key: bytes, tokens: int) -> None:
        self._seq += 1
        self._log.append((self._seq, key, tokens))

    def report(self, epoch: int, since: int) -> tuple[int, int, bool, list[tuple[bytes, int]]]:
        """(epoch, seq, full, changes): what changed after `since` (tokens 0: no longer held), or,
        when the caller's epoch is not this one or the log no longer reaches back to `since`,
        everything held (`full`)."""
        with self._lock:
            reaches = since >= (self._log[0][0] - 1 if self._log else self._seq)
            if epoch == self.epoch and reaches:
                return self.epoch, self._seq, False, [(k, t) for s, k, t in self._log if s > since]
            return self.epoch, self._seq, True, list(self._held.items())


