"""A session's history (sessions/conversation.py): a reply cut where the listener was keeps the
tokens the frames heard were made from, one a frame; a reply's tool calls (the thinker's events)
are its message's, unless it was cut before its end."""

from __future__ import annotations

from omni.v1 import common_pb2, omni_pb2
from sessions.conversation import END_TEXT, Conversation, Item, Reply

SPF = 1920  # samples a frame (Qwen3-Omni's real layout)


def reply_of(tokens: list[str], frames: int) -> Reply:
    reply = Reply()
    for i, text in enumerate(tokens):
        reply.add_text(omni_pb2.TextDelta(text=text, token_ids=[i]))
    reply.add_audio(common_pb2.AudioChunk(num_samples=frames * SPF - 555, sample_rate=24000, samples_per_frame=SPF))
    return reply


def test_a_cut_keeps_the_tokens_of_the_frames_heard():
    reply = reply_of(["He", "llo", " there", ",", " friend", END_TEXT], frames=40)
    reply.cut(audio_end_ms=3 * 80 - 10)  # inside frame 2: frames 0, 1 and 2 started playing
    assert reply.text == "Hello there"
    reply.cut(audio_end_ms=2000)  # past the text's end: all of it
    assert reply.text == "Hello there, friend"


def test_the_end_token_is_not_kept():
    assert reply_of(["Hi", END_TEXT], frames=10).text == "Hi"


def test_a_reply_cut_before_any_audio_played_leaves_no_message():
    conversation = Conversation()
    conversation.add(Item("u", omni_pb2.ROLE_USER, [omni_pb2.Content(text="hi")]))
    reply = reply_of(["Hello"], frames=10)
    reply.cut(0)
    conversation.add(Item("a", omni_pb2.ROLE_ASSISTANT, reply=reply))
    assert [m.role for m in conversation.messages()] == [omni_pb2.ROLE_USER]


def test_a_text_only_reply_keeps_its_text_when_cut():
    reply = Reply()
    reply.add_text(omni_pb2.TextDelta(text="Hello", token_ids=[1]))
    reply.cut(0)
    assert reply.text == "Hello"


def test_a_replys_calls_are_its_messages_unless_it_was_cut_before_its_end():
    call = omni_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Rome"}')
    reply = reply_of(["Sure", ".", "", "", END_TEXT], frames=2)  # the call's tokens carry no text
    reply.calls.append(call)
    item = Item("a", omni_pb2.ROLE_ASSISTANT, reply=reply)
    message = item.message()
    assert [c.text for c in message.content] == ["Sure."] and list(message.tool_calls) == [call]
    reply.cut(audio_end_ms=80)  # one frame heard: "Sure" only, and not the call after it
    assert [c.text for c in item.message().content] == ["Sure"] and not item.message().tool_calls
    only_call = Reply()
    only_call.add_text(omni_pb2.TextDelta(text="", token_ids=[7]))
    only_call.calls.append(call)
    message = Item("b", omni_pb2.ROLE_ASSISTANT, reply=only_call).message()
    assert not message.content and list(message.tool_calls) == [call]


def turns(n: int) -> Conversation:
    """A system item, then `n` turns of a user item and its reply."""
    conversation = Conversation()
    conversation.add(Item("sys", omni_pb2.ROLE_SYSTEM, [omni_pb2.Content(text="be brief")]))
    for i in range(n):
        conversation.add(Item(f"u{i}", omni_pb2.ROLE_USER, [omni_pb2.Content(text=f"q{i}")]))
        conversation.add(Item(f"a{i}", omni_pb2.ROLE_ASSISTANT, [omni_pb2.Content(text=f"r{i}")]))
    return conversation


def test_a_truncation_drops_the_oldest_turns_whole_and_keeps_system_items_and_the_newest():
    conversation = turns(10)
    assert conversation.drop_oldest_turns(0.8) == [f"{kind}{i}" for i in (0, 1) for kind in "ua"]
    assert [m.content[0].text for m in conversation.messages()][:3] == ["be brief", "q2", "r2"]
    assert conversation.drop_oldest_turns(0.5) == [f"{kind}{i}" for i in (2, 3, 4, 5) for kind in "ua"]
    for _ in range(3):  # at least one turn a time, never the last
        conversation.drop_oldest_turns(0.99)
    assert [m.content[0].text for m in conversation.messages()] == ["be brief", "q9", "r9"]
    assert conversation.drop_oldest_turns(0.5) == []
    assert len(conversation.items) == 21  # the items stay: only what is sent changed


def test_a_deleted_item_is_no_longer_sent_and_the_next_goes_after_the_one_before_it():
    conversation = turns(2)
    conversation.delete("a1")
    assert conversation.find("a1") is None and [m.content[0].text for m in conversation.messages()][-1] == "q1"
    assert conversation.add(Item("u2", omni_pb2.ROLE_USER, [omni_pb2.Content(text="q2")])) == "u1"
