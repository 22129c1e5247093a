"""Function calling's OpenAI shapes <-> omni.v1's (Tool, ToolChoice, ToolCall), for chat
completions and the Realtime API alike (docs/gateway.md, "Tools").

Chat completions nest a function (`{"type": "function", "function": {"name", ...}}`), the Realtime
API does not (`{"type": "function", "name", ...}`): `flat` says which. Every check happens here,
before the router is called, each refusal naming the caller's field through `fail(param, message)`
(a 400 for chat completions, an `error` event for a session); the definitions' own rules are the
pipeline's (services/base/tool_calls.py `check_tool`), so both APIs refuse the same things.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from omni.v1 import omni_pb2
from services.base.errors import InvalidArgument
from services.base.tool_calls import check_tool

Fail = Callable[[str, str], Exception]
_MODES = {"auto": omni_pb2.ToolChoice.MODE_AUTO, "none": omni_pb2.ToolChoice.MODE_NONE,
          "required": omni_pb2.ToolChoice.MODE_REQUIRED}


def tools_to_proto(tools, fail: Fail, param: str = "tools", flat: bool = False) -> list[omni_pb2.Tool]:
    if not isinstance(tools, list):
        raise fail(param, f"{param} must be a list of functions")
    out = []
    for i, tool in enumerate(tools):
        at = f"{param}[{i}]"
        if not isinstance(tool, dict):
            raise fail(at, f"{at} must be an object")
        if tool.get("type", "function") != "function":
            raise fail(f"{at}.type", f"{at}.type {tool.get('type')!r}: only function tools are served")
        function = tool if flat else tool.get("function")
        where = at if flat else f"{at}.function"
        if not isinstance(function, dict):
            raise fail(where, f"{where} must be an object")
        name, description = function.get("name"), function.get("description") or ""
        parameters = function.get("parameters")
        if not isinstance(name, str):
            raise fail(f"{where}.name", f"{where}.name is required (a string)")
        if not isinstance(description, str):
            raise fail(f"{where}.description", f"{where}.description must be a string")
        if parameters is not None and not isinstance(parameters, dict):
            raise fail(f"{where}.parameters", f"{where}.parameters must be an object (a JSON Schema)")
        proto = omni_pb2.Tool(name=name, description=description,
                              parameters=json.dumps(parameters) if parameters is not None else "")
        try:
            check_tool(proto.name, proto.description, proto.parameters, where)
        except InvalidArgument as exc:
            raise fail(exc.field, str(exc)) from None
        if name in (t.name for t in out):
            raise fail(f"{where}.name", f"{where}.name {name!r} is named twice")
        out.append(proto)
    return out


def tool_choice_to_proto(choice, tools: list[omni_pb2.Tool], fail: Fail, param: str = "tool_choice",
                         flat: bool = False) -> omni_pb2.ToolChoice:
    if isinstance(choice, str):
        if choice not in _MODES:
            raise fail(param, f"{param} must be none, auto, required or a function")
        if choice == "required" and not tools:
            raise fail(param, f"{param} is required, and there are no tools")
        return omni_pb2.ToolChoice(mode=_MODES[choice])
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise fail(param, f"{param} must be none, auto, required or {{\"type\": \"function\", ...}}")
    function = choice if flat else choice.get("function")
    where = param if flat else f"{param}.function"
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise fail(f"{where}.name", f"{where}.name is required (a string)")
    if name not in (t.name for t in tools):
        raise fail(f"{where}.name", f"{where}.name {name!r} is not one of the tools")
    return omni_pb2.ToolChoice(mode=omni_pb2.ToolChoice.MODE_FUNCTION, function=name)


def tool_calls_to_proto(calls, fail: Fail, param: str) -> list[omni_pb2.ToolCall]:
    """An assistant message's `tool_calls` (chat completions' shape)."""
    if not isinstance(calls, list):
        raise fail(param, f"{param} must be a list")
    out = []
    for k, call in enumerate(calls):
        at = f"{param}[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise fail(f"{at}.function.name", f"{at}.function.name is required (a string)")
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            raise fail(f"{at}.function.arguments", f"{at}.function.arguments must be a string (JSON)")
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise fail(f"{at}.id", f"{at}.id must be a string")
        out.append(omni_pb2.ToolCall(id=call_id, name=function["name"], arguments=arguments))
    return out


def openai_call(call: omni_pb2.ToolCall | omni_pb2.ToolCallDelta, index: int | None = None) -> dict:
    """The thinker's call (whole, or its first delta) as chat completions' `tool_calls` entry
    (`index` for a streamed delta)."""
    entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return entry if index is None else {"index": index, **entry}
