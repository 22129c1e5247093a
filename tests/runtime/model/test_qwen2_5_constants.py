"""The project's Qwen2.5-Omni constants against transformers' own values (the oracle's source),
so a constant that drifts fails here, not only where the tiny checkpoint happens to emit it."""

from __future__ import annotations

from services.runtime.model import qwen2_5_omni
from tests.qwen2_5_oracle import TALKER_EOS_IDS


def test_the_talker_end_ids_are_generate_s_defaults():
    assert TALKER_EOS_IDS == (8292, 8294)  # transformers 5.19's Qwen2_5OmniForConditionalGeneration.generate
    assert qwen2_5_omni.TALKER_EOS_IDS == TALKER_EOS_IDS
