"""Function calling end to end: the openai SDK's chat completions (streamed and not) and its
realtime client, unchanged, against the real stack, whose thinker's replies are scripted for these
prompts (tool_replies.py: the tiny checkpoint never calls a tool by itself). What is checked: a
call in Qwen's format comes back, parsed by the thinker alone, as a gRPC client's tool_call events
(the same token ids as the text without tools), as OpenAI's tool_calls (deltas when streamed,
finish_reason tool_calls) and as the Realtime API's function_call item and arguments events; a tool's result
goes back into the prompt and the reply answers it; the talker speaks only the text before a call
(its codec frames equal those of that text alone) and nothing of a reply that is only a call; bad
tools are refused naming the field."""

from __future__ import annotations

import json

import grpc
import pytest
from tool_replies import ANSWER, CALL_ROME, SPOKEN_FIRST

from omni.v1 import common_pb2, omni_pb2
from services.tools.client import collect

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_call_comes_back_as_tool_calls_and_its_result_is_answered(client):
    first = client.chat.completions.create(model="m", messages=PARIS, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The call and its result back into the prompt (the template's <tool_call> and <tool_response>).
    followed = client.chat.completions.create(model="m", tools=TOOLS, messages=[
        *PARIS, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})}])
    assert followed.choices[0].message.content == ANSWER
    assert followed.choices[0].finish_reason == "stop" and not followed.choices[0].message.tool_calls


@pytest.mark.parametrize(("prompt", "content", "cities"), [
    ("What is the weather in Rome?", SPOKEN_FIRST, ["Rome"]),
    ("Paris and Oslo weather, please.", "", ["Paris", "Oslo"]),
])
def test_streamed_calls_come_as_deltas(client, prompt, content, cities):
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                                            stream=True)
    text, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": part.id, "name": part.function.name, "arguments": "", "pieces": 0})
            entry["arguments"] += part.function.arguments or ""
            entry["pieces"] += 1
        finish = chunk.choices[0].finish_reason or finish
    assert text == content and finish == "tool_calls"
    assert all(c["pieces"] > 2 for c in calls.values())  # the arguments streamed as the model wrote them
    assert [json.loads(calls[k]["arguments"])["city"] for k in sorted(calls)] == cities
    assert all(c["id"].startswith("call_") and c["name"] == "get_weather" for c in calls.values())


def spoken(omni, prompt: str, forced: str | None = None, audio: bool = True, tools: bool = True) -> object:
    """A reply over gRPC (spoken, its codec frames returned; with the tools): scripted by `prompt`,
    or forced to `forced` (the same prompt either way)."""
    request = omni_pb2.GenerateRequest(voice="ethan", return_codec_frames=True, output_modalities=[
        omni_pb2.MODALITY_TEXT, *([omni_pb2.MODALITY_AUDIO] if audio else [])])
    if tools:
        request.tools.add(name="get_weather", parameters=json.dumps(TOOLS[0]["function"]["parameters"]))
    request.messages.add(role=omni_pb2.ROLE_USER).content.add(text=prompt)
    if forced is not None:
        request.forced_text = forced
    return collect(omni, request, timeout=120)


def test_a_grpc_client_gets_the_call_as_events_and_the_same_token_ids(omni):
    with_tools = spoken(omni, "What is the weather in Rome?", audio=False)
    plain = spoken(omni, "What is the weather in Rome?", forced=CALL_ROME, audio=False, tools=False)
    # The thinker's tokens are the same ones; only what is reported as text vs a call differs.
    assert with_tools.thinker_token_ids == plain.thinker_token_ids and plain.text.removesuffix("<|im_end|>") == CALL_ROME
    assert with_tools.text.removesuffix("<|im_end|>") == SPOKEN_FIRST and "<tool_call>" not in with_tools.text
    [call] = with_tools.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Rome", "unit": "C"}
    assert call.id.startswith("call_") and len(with_tools.tool_call_deltas) > 1
    assert all((d.index, d.id, d.name) == (0, call.id, call.name) for d in with_tools.tool_call_deltas)
    assert "".join(d.arguments for d in with_tools.tool_call_deltas) == call.arguments
    again = spoken(omni, "What is the weather in Rome?", audio=False)
    assert again.tool_calls[0].id != call.id  # each request its own ids (the router's request ids)
    assert omni.GetModelInfo(omni_pb2.ModelInfoRequest(), timeout=30).tools  # this pipeline takes tools


def test_the_talker_speaks_the_text_before_a_call_and_nothing_of_the_call(omni):
    before_call = spoken(omni, "What is the weather in Rome?")
    alone = spoken(omni, "What is the weather in Rome?", forced=SPOKEN_FIRST)
    assert before_call.text.removesuffix("<|im_end|>") == SPOKEN_FIRST and len(before_call.tool_calls) == 1
    assert alone.text.removesuffix("<|im_end|>") == SPOKEN_FIRST
    # The same text rows reached the talker: the same frames (greedy), however much text followed.
    assert before_call.codec_frames == alone.codec_frames and len(alone.codec_frames) > 0
    only_call = spoken(omni, "What is the weather in Paris?")
    assert only_call.text.removesuffix("<|im_end|>") == "" and only_call.tool_calls[0].name == "get_weather"
    assert only_call.codec_frames == [] and not only_call.audio_chunks
    assert only_call.final.usage.codec_frames == 0
    assert only_call.final.text_finish_reason == common_pb2.FINISH_REASON_STOP


def test_bad_tool_input_is_invalid_argument_naming_the_field(omni):
    request = omni_pb2.GenerateRequest(output_modalities=[omni_pb2.MODALITY_TEXT])
    request.messages.add(role=omni_pb2.ROLE_USER).content.add(text="Hi")
    request.messages.add(role=omni_pb2.ROLE_TOOL).content.add(text="no call named")
    with pytest.raises(grpc.RpcError) as caught:
        collect(omni, request, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages[1].tool_call_id" in caught.value.details()
    request = omni_pb2.GenerateRequest(tools=[omni_pb2.Tool(name="f")], tool_choice=omni_pb2.ToolChoice(
        mode=omni_pb2.ToolChoice.MODE_FUNCTION, function="g"))
    request.messages.add(role=omni_pb2.ROLE_USER).content.add(text="Hi")
    with pytest.raises(grpc.RpcError) as caught:
        collect(omni, request, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tool_choice.function" in caught.value.details()


REALTIME_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def response_events(conn) -> list:
    events = []
    for event in conn:
        events.append(event)
        if event.type == "response.done":
            return events
    raise AssertionError("the session ended before response.done")


def test_the_sdks_realtime_client_gets_a_function_call_and_sends_its_output(client):
    with client.realtime.connect(model="tiny-qwen3-omni") as conn:
        conn.recv()  # session.created
        conn.session.update(session={"type": "realtime", "tools": REALTIME_TOOLS, "tool_choice": "auto",
                                     "audio": {"input": {"turn_detection": None}, "output": {"voice": "alloy"}}})
        updated = conn.recv()
        assert updated.type == "session.updated" and updated.session.tools[0].name == "get_weather"
        conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What is the weather in Paris?"}]})
        conn.response.create()
        events = response_events(conn)
        types = [e.type for e in events]
        assert "response.output_audio.delta" not in types  # a reply that is only a call says nothing
        deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert types.index("response.output_item.added") < types.index(deltas[0].type) < types.index(done.type)
        assert len(deltas) > 1 and all((d.item_id, d.call_id) == (done.item_id, done.call_id) for d in deltas)
        assert done.name == "get_weather" and json.loads(done.arguments) == {"city": "Paris"}
        assert "".join(d.delta for d in deltas) == done.arguments  # streamed as the model wrote it
        [item] = [o for o in events[-1].response.output if o.type == "function_call"]
        assert (item.call_id, item.id, item.arguments) == (done.call_id, done.item_id, done.arguments)
        conn.conversation.item.create(item={"type": "function_call_output", "call_id": done.call_id,
                                            "output": json.dumps({"temp": 21})})
        added = [conn.recv(), conn.recv()]
        assert [a.type for a in added] == ["conversation.item.added", "conversation.item.done"]
        assert added[0].item.type == "function_call_output" and added[0].item.call_id == done.call_id
        conn.response.create()
        answer = response_events(conn)
    transcript = "".join(e.delta for e in answer if e.type == "response.output_audio_transcript.delta")
    assert transcript == ANSWER == answer[-1].response.output[0].content[0].transcript
    assert any(e.type == "response.output_audio.delta" for e in answer)
    assert not any(e.type.startswith("response.function_call") for e in answer)


def test_a_response_with_its_own_tools_and_input_calls_out_of_band_and_the_conversation_stays_as_it_was(client):
    """The session has no tools: one out-of-band response.create brings its own (and its
    tool_choice), its own input, and gets the call; no conversation item comes of it, and the
    retrieve of its call fails. (tool_choice "auto": with "required" the thinker's forced call
    opening and the scripted reply give the call as raw text, a plain Generate's too.)"""
    with client.realtime.connect(model="tiny-qwen3-omni") as conn:
        conn.recv()  # session.created
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                     "audio": {"input": {"turn_detection": None}}})
        assert conn.recv().session.tools == []
        conn.response.create(response={
            "conversation": "none", "tools": REALTIME_TOOLS, "tool_choice": "auto",
            "input": [{"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What is the weather in Paris?"}]}]})
        events = response_events(conn)
        conn.conversation.item.retrieve(item_id=events[-1].response.output[0].id)
        refused = conn.recv()
    assert not [e for e in events if e.type.startswith("conversation.")]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "get_weather" and json.loads(done.arguments) == {"city": "Paris"}
    response = events[-1].response
    assert response.conversation_id is None and [o.type for o in response.output] == ["function_call"]
    assert refused.type == "error" and refused.error.code == "item_retrieve_invalid_item_id"
