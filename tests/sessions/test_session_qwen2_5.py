"""Realtime sessions on Qwen2.5-Omni: a turn equals the one-shot Generate of its history (greedy ids
and codec codes), a reply cut at a played position keeps one token a code heard (Token2Wav's
`samples_per_frame`, 480 samples a code), and tools, which its chat template cannot render, are
refused where they are set (a Generate, a session's update), on a stack of the tiny Qwen2.5-Omni
checkpoint."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from omni.v1 import omni_pb2
from sessions.audio import wav_bytes
from tests.sessions.session_support import MANUAL, RATE, SessionCall, one_shot, sampling, speech

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack25(tiny_qwen2_5_checkpoint):
    from tests.stacks import stack_of

    with stack_of(tiny_qwen2_5_checkpoint) as stack:
        yield stack


@pytest.mark.exactness
def test_qwen2_5_turns_equal_the_one_shot_request_of_their_history_with_the_played_part_only(stack25):
    from services.tools.client import connect

    channel, omni = connect(stack25.target)
    call = SessionCall(stack25.sessions_target)
    try:
        call.next_event("created")
        call.send(update=omni_pb2.SessionSettings(turn_detection=MANUAL, thinker_sampling=sampling(8),
                                                  talker_sampling=sampling(60), return_codec_frames=True))
        call.next_event("updated")
        user1 = speech(1)
        call.speak(user1)
        call.send(commit=omni_pb2.CommitInput())
        call.send(create_response=omni_pb2.CreateResponse())
        first = call.next_event("response_created")
        ids1, frames1, done1 = call.response(first.response_id)
        history = [omni_pb2.Message(role=omni_pb2.ROLE_USER,
                                    content=[omni_pb2.Content(audio=wav_bytes(np.frombuffer(user1, "<i2"), RATE))])]
        assert (ids1, frames1) == one_shot(omni, history, 8, 60)
        audio = [e.audio for e in call.events if e.response_id == first.response_id and e.WhichOneof("event") == "audio"]
        assert audio and audio[0].samples_per_frame == 480
        # The listener heard 50 ms: 1,200 samples, three codes begun (480 samples each): three tokens.
        call.send(truncate=omni_pb2.TruncateItem(item_id=first.response_created.item_id, audio_end_ms=50))
        truncated = call.next_event("truncated").truncated
        texts = [e.text.text for e in call.events if e.response_id == first.response_id and e.WhichOneof("event") == "text"]
        assert truncated.text == "".join(texts[:3])
        call.send(create_item=omni_pb2.CreateItem(message=omni_pb2.Message(
            role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(text="Sorry, go on.")])))
        call.next_event("item_added")
        call.send(create_response=omni_pb2.CreateResponse())
        second = call.next_event("response_created")
        ids2, frames2, _ = call.response(second.response_id)
        history += [omni_pb2.Message(role=omni_pb2.ROLE_ASSISTANT, content=[omni_pb2.Content(text=truncated.text)]),
                    omni_pb2.Message(role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(text="Sorry, go on.")])]
        assert (ids2, frames2) == one_shot(omni, history, 8, 60)
    finally:
        call.close()
        channel.close()


def test_tools_are_refused_where_they_are_set_when_the_chat_template_cannot_render_them(stack25):
    from services.tools.client import collect, connect

    channel, omni = connect(stack25.target)
    call = SessionCall(stack25.sessions_target)
    try:
        info = omni.GetModelInfo(omni_pb2.ModelInfoRequest(), timeout=30)
        assert info.HasField("tools") and not info.tools
        request = omni_pb2.GenerateRequest(tools=[omni_pb2.Tool(name="get_weather")],
                                           output_modalities=[omni_pb2.MODALITY_TEXT])
        request.messages.add(role=omni_pb2.ROLE_USER).content.add(text="Hi")
        with pytest.raises(grpc.RpcError) as caught:
            collect(omni, request, timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools" in caught.value.details()
        call.next_event("created")
        call.send(update=omni_pb2.SessionSettings(tools=[omni_pb2.Tool(name="get_weather")], tools_set=True))
        refused = call.next_event("error", "updated")
        assert refused.WhichOneof("event") == "error" and refused.error.field == "update.tools"
        call.send(update=omni_pb2.SessionSettings(turn_detection=MANUAL))  # the session goes on, without tools
        assert not call.next_event("updated").updated.settings.tools
    finally:
        call.close()
        channel.close()
