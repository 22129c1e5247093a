"""Qwen's tool-call format (services/base/tool_calls.py): the parser gives the same content and
calls however the text is cut into deltas, and the speech gate lets through exactly the tokens
before a call, holding only those that might begin one."""

from __future__ import annotations

import pytest

from services.base.errors import InvalidArgument
from services.base.tool_calls import ParsedCall, SpeechGate, ToolCallParser, call_opening, check_tool, check_tools

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARIS = ParsedCall("get_weather", '{"city": "Paris"}')


def parse(text: str, step: int) -> list:
    parser = ToolCallParser()
    out = [p for i in range(0, len(text), step) for p in parser.feed(text[i:i + step])] + parser.finish()
    merged = []  # content pieces joined, as a reader adds them up
    for piece in out:
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        else:
            merged.append(piece)
    return merged


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("text", "expected"), [
    ("Hello <b>there</b> a < b", ["Hello <b>there</b> a < b"]),
    (CALL, [PARIS]),
    ("Let me look.\n" + CALL, ["Let me look.\n", PARIS]),
    (CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n", [PARIS, ParsedCall("get_weather", '{"city": "Oslo"}')]),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', [ParsedCall("f", '{"a": 1}')]),
    ("<tool_call>not json</tool_call> ok", ["<tool_call>not json</tool_call> ok"]),  # stays content
    (CALL[:-len("</tool_call>")], [PARIS]),  # cut off at the end of the reply, its JSON whole
    ("x <tool_cal", ["x <tool_cal"]),  # an opening that never completes is content at the end
])
def test_the_parser_gives_the_same_content_and_calls_however_the_text_is_cut(text, expected, step):
    assert parse(text, step) == expected


def test_content_that_might_open_a_call_is_held_until_it_does_not():
    parser = ToolCallParser()
    assert parser.feed("a <tool") == ["a "]
    assert parser.feed("s") == ["<tools"]


def gate_run(pieces: list[str], last_flush: bool = True) -> tuple[list[int], int | None]:
    gate, spoken, first = SpeechGate(), [], None
    for i, text in enumerate(pieces):
        ready, call = gate.add(i, text)
        spoken += ready
        if call is not None:
            first = call
    if first is None and last_flush:
        spoken += gate.flush()
    return spoken, first


def test_the_gate_speaks_the_tokens_before_a_call_and_none_of_it():
    # Tokens as the tiny tokenizer spells the opening: in pieces.
    pieces = ["Sure", ".", "\n", "<", "tool", "_", "call", ">", "\n{", "..."]
    assert gate_run(pieces) == ([0, 1, 2], 3)
    assert gate_run(["<tool_call>", "{"]) == ([], 0)  # as one token (Qwen's own tokenizers)
    assert gate_run(["a <", "tool_call>"]) == ([], 0)  # a token holding part of the opening is not spoken


def test_the_gate_releases_what_it_held_when_no_call_follows():
    gate = SpeechGate()
    assert gate.add(0, "a <") == ([], None)
    assert gate.add(1, "tool") == ([], None)
    assert gate.add(2, "s>") == ([0, 1, 2], None)
    assert gate.add(3, "<") == ([], None)
    assert gate.flush() == [3]  # the reply ended


def test_tool_definitions_are_checked_naming_the_field():
    assert check_tool("get_weather", "", '{"type": "object"}', "tools[0]") == {
        "type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    for args, field in [(("", "", ""), "tools[0].name"), (("a b", "", ""), "tools[0].name"),
                        (("f", "", "[]"), "tools[0].parameters"), (("f", "", "{"), "tools[0].parameters")]:
        with pytest.raises(InvalidArgument) as caught:
            check_tool(*args, "tools[0]")
        assert caught.value.field == field
    with pytest.raises(InvalidArgument) as caught:
        check_tools([("f", "", ""), ("f", "", "")], "tools")
    assert caught.value.field == "tools[1].name"


def test_a_forced_opening_parses_with_what_the_model_writes_after_it():
    text = call_opening("get_weather") + '{"city": "Paris"}}\n</tool_call>'
    assert parse(text, 5) == [PARIS]
    assert parse(call_opening(None) + CALL[len("<tool_call>\n"):], 4) == [PARIS]
