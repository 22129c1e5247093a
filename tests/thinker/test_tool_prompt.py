"""Function calling in the thinker's prompt: a request's tools, its assistant calls and its tool
results rendered by the checkpoint's own chat template exactly as transformers'
`apply_chat_template(tools=...)` renders them (the tiny checkpoint's template writes them as
Qwen3-Omni's does), tool_choice's forced opening after the generation prompt, and the bad requests
refused naming the field before anything is built."""

from __future__ import annotations

import json

import pytest

from omni.v1 import omni_pb2
from services.base.errors import InvalidArgument
from services.runtime.inputs.prompt import PromptBuilder
from services.thinker.admission import Tools, messages_from_proto, prompt_prefix

WEATHER = omni_pb2.Tool(name="get_weather", description="The weather in a city",
                        parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))
MODE = omni_pb2.ToolChoice


@pytest.fixture(scope="module")
def builder(tiny_checkpoint) -> PromptBuilder:
    from transformers import Qwen3OmniMoeConfig

    return PromptBuilder(tiny_checkpoint, Qwen3OmniMoeConfig.from_pretrained(tiny_checkpoint))


def conversation(**request) -> omni_pb2.GenerateRequest:
    r = omni_pb2.GenerateRequest(tools=[WEATHER], **request)
    r.messages.add(role=omni_pb2.ROLE_SYSTEM).content.add(text="Be brief.")
    r.messages.add(role=omni_pb2.ROLE_USER).content.add(text="What is the weather in Paris?")
    r.messages.add(role=omni_pb2.ROLE_ASSISTANT, tool_calls=[omni_pb2.ToolCall(
        id="call_1", name="get_weather", arguments='{"city": "Paris"}')])
    r.messages.add(role=omni_pb2.ROLE_TOOL, tool_call_id="call_1").content.add(text='{"temp": 21}')
    return r


def test_tools_calls_and_results_are_rendered_as_transformers_renders_them(builder):
    request = conversation()
    tools = Tools.of(request)
    prompt = builder.build(messages_from_proto(request), tools=tools.tools)
    expected = builder.tokenizer.apply_chat_template([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ], tools=[{"type": "function", "function": {"name": WEATHER.name, "description": WEATHER.description,
                                                "parameters": json.loads(WEATHER.parameters)}}],
        add_generation_prompt=True, tokenize=False)
    text = builder.decode(prompt.input_ids[0].tolist())
    assert text == expected
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n' in text
    # One turn per message, the tools in the system's: the prefix cache keys it.
    assert prompt_prefix(request, prompt.input_ids[0], builder.tokenizer.convert_tokens_to_ids("<|im_start|>"),
                         tools=True) is not None


def test_without_tools_the_prompt_is_unchanged(builder):
    request = conversation(tool_choice=MODE(mode=MODE.MODE_NONE))
    assert Tools.of(request).tools is None
    plain = builder.build(messages_from_proto(request))
    assert "# Tools" not in builder.decode(plain.input_ids[0].tolist())


@pytest.mark.parametrize(("choice", "opening"), [
    (MODE(mode=MODE.MODE_REQUIRED), "<tool_call>\n"),
    (MODE(mode=MODE.MODE_FUNCTION, function="get_weather"), '<tool_call>\n{"name": "get_weather", "arguments": '),
])
def test_a_required_call_opens_the_reply_in_the_prompt(builder, choice, opening):
    request = conversation(tool_choice=choice)
    tools = Tools.of(request)
    assert tools.reply_prefix == opening
    prompt = builder.build(messages_from_proto(request), tools=tools.tools, reply_prefix=tools.reply_prefix)
    assert builder.decode(prompt.input_ids[0].tolist()).endswith("<|im_start|>assistant\n" + opening)


def bad(request: omni_pb2.GenerateRequest) -> str:
    with pytest.raises(InvalidArgument) as caught:
        Tools.of(request)
        messages_from_proto(request)
    return caught.value.field


def test_bad_tools_are_refused_naming_the_field():
    assert bad(omni_pb2.GenerateRequest(tools=[omni_pb2.Tool(name="")])) == "tools[0].name"
    assert bad(omni_pb2.GenerateRequest(tools=[omni_pb2.Tool(name="f", parameters="[1]")])) == "tools[0].parameters"
    assert bad(conversation(tool_choice=MODE(mode=MODE.MODE_FUNCTION, function="nope"))) == "tool_choice.function"
    assert bad(omni_pb2.GenerateRequest(tool_choice=MODE(mode=MODE.MODE_REQUIRED))) == "tool_choice"
    no_id = conversation()
    no_id.messages[3].tool_call_id = ""
    assert bad(no_id) == "messages[3].tool_call_id"
    user_calls = conversation()
    user_calls.messages[1].tool_calls.add(name="get_weather")
    assert bad(user_calls) == "messages[1].tool_calls"
