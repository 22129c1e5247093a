"""A session's history (sessions/conversation.py): a reply cut where the listener was keeps the
tokens the frames heard were made from, one a frame."""

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
