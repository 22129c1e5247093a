"""The one reader of Qwen's tool calls in a reply (services/base/tool_calls.py has the format): the
thinker parses each reply of a request with tools as it streams, and everyone downstream (the
router, the gateway, the sessions service, gRPC clients) reads its `tool_call_delta` and
`tool_call` events (omni.proto's GenerateResponse) instead of the tags.

- `ToolCallParser`, fed the reply's text as it comes, gives its content (holding back only what
  might open a call) and its calls: once a call's head `{"name": "...", "arguments": ` is written,
  its arguments stream as `CallDelta`s, as the model writes them, each held back only by what might
  be the call's own closing `}` or `</tool_call>`; at its closing tag (or the reply's end) a
  `Call` with the arguments whole (the deltas joined). A call written in another shape (its
  arguments first) is taken whole at its closing tag; a body that is not {"name": str, "arguments":
  ...} stays content, as Qwen's own parser leaves it.
- `SpeechGate` lets the talker have the tokens before a reply's first `<tool_call>` and holds the
  few whose text might be its start (a tokenizer without `<tool_call>` as one token, the tiny
  checkpoints', spells it in pieces).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from services.base.tool_calls import CLOSE, OPEN

# The head of a call as Qwen writes it: {"name": "<name>", "arguments": <- the arguments start here.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def partial_end(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (0: none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass(frozen=True)
class CallDelta:
    index: int  # the call's place among the reply's calls
    name: str
    arguments: str  # the next piece of its arguments' JSON text


@dataclass(frozen=True)
class Call:
    index: int
    name: str
    arguments: str  # JSON text as written (its deltas joined, when it streamed)


Piece = str | CallDelta | Call  # str: content text


def call_id(request_id: str, index: int) -> str:
    """A call's id: the same for a replay of the request (the router checks a replay's events
    against what it passed up), unique per request id."""
    return "call_" + hashlib.sha256(f"{request_id}\x00{index}".encode()).hexdigest()[:24]


def parse_call(body: str) -> tuple[str, str] | None:
    """A call's JSON (between the tags) -> (name, arguments); None when it is not
    {"name": str, "arguments": ...}."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return value["name"], arguments


def _arguments_so_far(body: str, closed: bool) -> str:
    """A streaming call's arguments in `body` (what follows its head): all but the call's own
    closing `}` and what may still be `</tool_call>` (`closed`: the tag came, nothing is pending),
    and the whitespace around them."""
    end = len(body) - (0 if closed else partial_end(body, CLOSE))
    text = body[:end].strip()
    if text.endswith("}"):
        text = text[:-1].rstrip()
    return text


class ToolCallParser:
    """A reply's text in, its content (str), CallDelta and Call pieces out, in order."""

    def __init__(self):
        self.buffer = ""  # content that might open a call, or the call being written (after OPEN)
        self.in_call = False
        self.head: re.Match | None = None  # the call's head, once written: its arguments stream
        self.sent = 0  # characters of the call's arguments sent as deltas
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while True:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start < 0:
                    cut = len(self.buffer) - partial_end(self.buffer, OPEN)
                    self._content(out, self.buffer[:cut])
                    self.buffer = self.buffer[cut:]
                    return out
                self._content(out, self.buffer[:start])
                self.buffer, self.in_call, self.head, self.sent = self.buffer[start + len(OPEN):], True, None, 0
                continue
            end = self.buffer.find(CLOSE)
            if self.head is None:
                self.head = _HEAD.match(self.buffer[:end] if end >= 0 else self.buffer)
                if self.head is not None:  # the name is written: the call streams from here
                    out.append(CallDelta(self.calls, self._name(), ""))
            if end < 0:
                if self.head is not None:
                    self._stream(out, _arguments_so_far(self.buffer[self.head.end():], closed=False))
                return out
            self._end_call(out, self.buffer[:end], CLOSE)
            self.buffer, self.in_call = self.buffer[end + len(CLOSE):], False

    def finish(self) -> list[Piece]:
        """The reply ended: what is still held (a call cut off by the end is taken as far as it goes)."""
        out: list[Piece] = []
        if self.in_call:
            self._end_call(out, self.buffer, "")
        else:
            self._content(out, self.buffer)
        self.buffer, self.in_call = "", False
        return out

    def _name(self) -> str:
        try:
            return json.loads(f'"{self.head.group(1)}"')
        except ValueError:
            return self.head.group(1)

    def _stream(self, out: list[Piece], arguments: str) -> None:
        if len(arguments) > self.sent:
            out.append(CallDelta(self.calls, self._name(), arguments[self.sent:]))
            self.sent = len(arguments)

    def _end_call(self, out: list[Piece], body: str, close: str) -> None:
        if self.head is not None:
            arguments = _arguments_so_far(body[self.head.end():], closed=True)
            self._stream(out, arguments)
            out.append(Call(self.calls, self._name(), arguments))
            self.calls += 1
            return
        call = parse_call(body)
        if call is None:
            self._content(out, OPEN + body + close)
        else:
            out.append(Call(self.calls, *call))
            self.calls += 1

    def _content(self, out: list[Piece], text: str) -> None:
        # Between and after calls the model writes newlines: not content.
        if text and not (self.calls and not text.strip()):
            out.append(text)


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
        cut = start if start >= 0 else len(held) - partial_end(held, OPEN)
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
