"""Function calling in Qwen's format, shared by every process that touches it (standard library only).

The model is told of its tools by the checkpoint's chat template (a `# Tools` system block with
each function's JSON in <tools></tools>, as transformers' `apply_chat_template(tools=...)`
renders it) and calls one by writing `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
in its reply. Three readers of a reply's streamed text need that format:

- the thinker, so the talker never speaks a call: `SpeechGate` lets through the tokens before a
  reply's first `<tool_call>` and holds the few whose text might be its start (a tokenizer without
  `<tool_call>` as one token, the tiny checkpoints', spells it in pieces);
- the router's sessions and the gateway, which turn the text into content and calls:
  `ToolCallParser`, fed the text deltas as they come, gives the content text (holding back only
  what might open a call) and each call once its closing tag comes (a call cut off by the end of
  the reply is taken if its JSON is whole). A call whose JSON is not a name and arguments stays
  content, as Qwen's own parser leaves it.

`check_tool` is the one check of a tool's definition (the thinker's admission, the router's
session settings): each refusal an InvalidArgument naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

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


def _partial_open(text: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of OPEN (0: none)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def parse_call(body: str) -> ParsedCall | None:
    """A call's JSON (between the tags) -> the call; None when it is not {"name": str, "arguments": ...}."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(value["name"], arguments)


class ToolCallParser:
    """A reply's text deltas in, content text (str) and calls (ParsedCall) out, in order."""

    def __init__(self):
        self.buffer = ""
        self.in_call = False
        self.calls = 0

    def feed(self, text: str) -> list[str | ParsedCall]:
        self.buffer += text
        out: list[str | ParsedCall] = []
        while True:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start < 0:
                    keep = _partial_open(self.buffer)
                    self._content(out, self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                self._content(out, self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(OPEN):], True
            else:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return out
                self._call(out, self.buffer[:end], CLOSE)
                self.buffer, self.in_call = self.buffer[end + len(CLOSE):], False

    def finish(self) -> list[str | ParsedCall]:
        """The reply ended: what is still held."""
        out: list[str | ParsedCall] = []
        if self.in_call:
            self._call(out, self.buffer, "")
        else:
            self._content(out, self.buffer)
        self.buffer, self.in_call = "", False
        return out

    def _content(self, out: list, text: str) -> None:
        # Between and after calls the model writes newlines: not content.
        if text and not (self.calls and not text.strip()):
            out.append(text)

    def _call(self, out: list, body: str, close: str) -> None:
        call = parse_call(body)
        if call is None:
            self._content(out, OPEN + body + close)
        else:
            self.calls += 1
            out.append(call)


class SpeechGate:
    """Which of a reply's tokens the talker may speak: those before its first `<tool_call>`. `add`
    takes each token (any object) with its text and answers (the tokens that may be spoken now, in
    order; the first token of the call, the moment the call shows, else None). A token whose text
    might begin the call is held until the next tokens tell; one that holds any of the call's
    opening is not spoken."""

    def __init__(self):
        self.pending: list[tuple[object, str]] = []
        self.stopped = False

    def add(self, token, text: str) -> tuple[list, object | None]:
        if self.stopped:
            return [], None
        self.pending.append((token, text))
        held = "".join(t for _, t in self.pending)
        start = held.find(OPEN)
        cut = start if start >= 0 else len(held) - _partial_open(held)
        ready, end = [], 0
        while self.pending and end + len(self.pending[0][1]) <= cut:
            end += len(self.pending[0][1])
            ready.append(self.pending.pop(0)[0])
        if start < 0:
            return ready, None
        self.stopped = True
        first = self.pending[0][0]
        self.pending = []
        return ready, first

    def flush(self) -> list:
        """The reply ended without a call: every token held may be spoken."""
        ready = [token for token, _ in self.pending]
        self.pending = []
        return ready
