"""omni-bench --conversations' own arithmetic and requests, without a stack (the stacks it starts are
the launcher's; tests/e2e/test_conversation.py runs a conversation through one)."""

from __future__ import annotations

import pytest

from bench.config import build_parser, config_from_args
from bench.conversations import Conversation, TurnRecord, cacheable_tokens, new_conversations, user_turn
from omni.v1 import omni_pb2
from services.base.errors import UserError


def test_cacheable_tokens_are_the_previous_prompt_s_whole_blocks_the_turn_may_take():
    records = [TurnRecord("s", 0, t, prompt_tokens=n) for t, n in enumerate((100, 260, 261, 262))]
    # turn 2: 100 // 16 = 6 blocks; turn 3: 260 // 16 = 16 blocks (the turn may take (261 - 1) // 16 = 16);
    # turn 4: 261 // 16 = 16 blocks
    assert cacheable_tokens([Conversation(0, omni_pb2.GenerateRequest(), records)]) == (6 + 16 + 16) * 16
    first_turn_only = [Conversation(1, omni_pb2.GenerateRequest(), records[:1])]
    assert cacheable_tokens(first_turn_only) == 0


def test_every_conversation_has_its_own_history_and_the_requested_outputs():
    conversations = new_conversations(3, audio=True, max_new_tokens=8, talker_max_new_tokens=16)
    systems = {c.request.messages[0].content[0].text for c in conversations}
    assert len(systems) == 3, "no two conversations share a block"
    assert list(conversations[0].request.output_modalities) == [omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO]
    assert conversations[0].request.talker_sampling.max_new_tokens == 16
    text_only = new_conversations(1, audio=False, max_new_tokens=8, talker_max_new_tokens=16)[0].request
    assert list(text_only.output_modalities) == [omni_pb2.MODALITY_TEXT]
    assert user_turn(0, 1) != user_turn(1, 1) != user_turn(0, 2)


def test_the_flags_are_checked(tiny_checkpoint):
    args = build_parser().parse_args(["--checkpoint", str(tiny_checkpoint), "--conversations", "4", "--turns", "3"])
    config = config_from_args(args)
    assert (config.conversations, config.turns, config.routing_conversations) == (4, 3, 16)
    with pytest.raises(UserError, match="--turns"):
        config_from_args(build_parser().parse_args(["--checkpoint", str(tiny_checkpoint), "--conversations", "4",
                                                    "--turns", "1"]))
