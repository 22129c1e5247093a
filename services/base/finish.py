"""Finish reasons shared by the engines (services/serving/convert.py maps them to omni.v1.FinishReason)."""

from __future__ import annotations

import enum


class FinishReason(enum.Enum):
    STOP = "stop"  # the model emitted its end token
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"
