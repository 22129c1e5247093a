"""Finish reasons shared by the engines (mapped to omni.v1.FinishReason at the edges)."""

from __future__ import annotations

import enum


class FinishReason(enum.Enum):
    STOP = "stop"  # the model emitted its end token
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"

    def to_proto(self) -> int:
        from omni.v1 import common_pb2

        return {
            FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
            FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
            FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
        }[self]
