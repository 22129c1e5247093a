"""Routing a conversation to the thinker replica that holds its prefix.

Each thinker replica with a prefix cache reports, on its load report, the message-prefix keys
whose prompt blocks it holds and how many tokens each covers (services/serving/prefix_keys.py:
key j names messages 0..j of a request, media by their bytes' digest). The router keeps one
`PrefixView` per replica, updated from each poll with the changes since the last one, and
computes the same keys from a new request's messages, without a tokenizer; the longest key a
replica holds is the number of the request's prompt tokens that replica would not prefill again.

NOTE: the score. A replica's cost is its load (requests, as least-loaded routing counts it) less
`prefix_weight` requests per 1,000 tokens it holds of the request's prefix, the way Dynamo's KV
router weighs overlap blocks against load: with the default 4, a 1,500-token history is worth
6 requests of load, so a conversation stays where its history is until that replica is 6
requests busier than another. A replica that is saturated (requests waiting for a KV slot) gets
no credit: a hit never sends a request to a queue.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from omni.v1 import common_pb2

DEFAULT_PREFIX_WEIGHT = 4.0  # requests of load one 1,000 cached tokens are worth


class Routing(enum.StrEnum):
    PREFIX = "prefix"  # least loaded, less the credit of the prefix a replica holds (the default)
    LEAST_LOADED = "least-loaded"
    RANDOM = "random"  # any healthy replica: the baseline prefix routing is measured against


@dataclass
class PrefixView:
    """What one thinker replica reported holding: message key -> tokens."""

    epoch: int = 0  # the replica's start the view is of (0: none yet)
    seq: int = 0  # the last change seen
    held: dict[bytes, int] = field(default_factory=dict)

    def request(self) -> common_pb2.LoadRequest:
        """The poll that asks for the changes since this view's last one."""
        return common_pb2.LoadRequest(prefix_epoch=self.epoch, prefix_since=self.seq)

    def apply(self, report: common_pb2.PrefixReport) -> None:
        if report.full or report.epoch != self.epoch:
            self.held = {}
        self.epoch, self.seq = report.epoch, report.seq
        for change in report.held:
            if change.tokens:
                self.held[change.key] = change.tokens
            else:
                self.held.pop(change.key, None)

    def matched(self, keys: list[bytes]) -> int:
        """Prompt tokens held of the longest message prefix of `keys` this replica holds."""
        for key in reversed(keys):
            tokens = self.held.get(key)
            if tokens:
                return tokens
        return 0
