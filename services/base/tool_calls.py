"""Function calling in Qwen's format: the definitions' checks, shared by every process that takes
tools (standard library only).

The model is told of its tools by the checkpoint's chat template (a `# Tools` system block with
each function's JSON in <tools></tools>, as transformers' `apply_chat_template(tools=...)`
renders it) and calls one by writing `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
in its reply. Only the thinker reads a reply's tags (services/thinker/tool_calls.py); everyone
else reads its tool_call events.

`check_tool` is the one check of a tool's definition (the thinker's admission, the gateway, the
sessions service's settings): each refusal an InvalidArgument naming the field.
"""

from __future__ import annotations

import json
import re

from services.base.errors import InvalidArgument

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_tool(name: str, description: str, parameters: str, where: str) -> dict:
    """A function's definition -> the dict the chat template renders (OpenAI's shape:
    {"type": "function", "function": {"name", "description", "parameters"}})."""
    if not _NAME.match(name):
        raise InvalidArgument(f"{where}.name", f"{name!r}: a function name is 1 to 64 of A-Z, a-z, 0-9, _ and -")
    function: dict = {"name": name}
    if description:
        function["description"] = description
    if parameters:
        try:
            schema = json.loads(parameters)
        except ValueError as exc:
            raise InvalidArgument(f"{where}.parameters", f"not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidArgument(f"{where}.parameters", "must be a JSON object (a JSON Schema)")
        function["parameters"] = schema
    return {"type": "function", "function": function}


def check_tools(tools: list[tuple[str, str, str]], where: str) -> list[dict]:
    """Each (name, description, parameters) checked, names unique; the template's dicts."""
    out, names = [], set()
    for i, (name, description, parameters) in enumerate(tools):
        out.append(check_tool(name, description, parameters, f"{where}[{i}]"))
        if name in names:
            raise InvalidArgument(f"{where}[{i}].name", f"{name!r} is named twice")
        names.add(name)
    return out


def call_opening(name: str | None) -> str:
    """What a reply that must call a tool starts with (tool_choice required, or one function)."""
    return OPEN + "\n" + ("" if name is None else '{"name": ' + json.dumps(name) + ', "arguments": ')
