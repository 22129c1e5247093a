"""The thinker's parser of Qwen's tool calls (services/thinker/tool_calls.py): the same content,
calls and argument deltas however the reply's text is cut into chunks (at every position, inside
the tags and inside the JSON), the deltas of a call joined equal to its arguments; and the speech
gate lets through exactly the tokens before a call, holding only those that might begin one."""

from __future__ import annotations

import itertools
import json

import pytest

from services.base.tool_calls import call_opening
from services.thinker.tool_calls import Call, CallDelta, SpeechGate, ToolCallParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARIS = Call(0, "get_weather", '{"city": "Paris"}')


def parse(chunks: list[str]) -> list:
    """The pieces, content pieces joined and each call's deltas joined (checked against its Call)."""
    parser = ToolCallParser()
    out = [p for chunk in chunks for p in parser.feed(chunk)] + parser.finish()
    merged, streamed = [], {}  # call index -> its deltas' arguments joined
    for piece in out:
        if isinstance(piece, CallDelta):
            assert piece.index not in {p.index for p in merged if isinstance(p, Call)}, "a delta after its call"
            streamed[piece.index] = streamed.get(piece.index, "") + piece.arguments
        elif isinstance(piece, Call):
            if piece.index in streamed:
                assert streamed.pop(piece.index) == piece.arguments
            merged.append(piece)
        elif merged and isinstance(merged[-1], str):
            merged[-1] += piece
        else:
            merged.append(piece)
    assert not streamed, "deltas without their call"
    return merged


def cuts(text: str, positions) -> list[str]:
    bounds = [0, *positions, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


REPLIES = [
    ("Hello <b>there</b> a < b", ["Hello <b>there</b> a < b"]),
    (CALL, [PARIS]),
    ("Let me look.\n" + CALL, ["Let me look.\n", PARIS]),
    (CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n", [PARIS, Call(1, "get_weather", '{"city": "Oslo"}')]),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', [Call(0, "f", '"{\\"a\\": 1}"')]),
    ('<tool_call>{"arguments": {"a": "}"}, "name": "f"}</tool_call>', [Call(0, "f", '{"a": "}"}')]),  # whole
    ('<tool_call>\n{"name": "f", "arguments": {"s": "</tool", "n": [1, {}]}}\n</tool_call>',
     [Call(0, "f", '{"s": "</tool", "n": [1, {}]}')]),
    ("<tool_call>not json</tool_call> ok", ["<tool_call>not json</tool_call> ok"]),  # stays content
    (CALL[:-len("</tool_call>")], [PARIS]),  # cut off at the end of the reply, its JSON whole
    ('<tool_call>{"name": "f", "arguments": {"a": [1, 2', [Call(0, "f", '{"a": [1, 2')]),  # as far as written
    ("x <tool_cal", ["x <tool_cal"]),  # an opening that never completes is content at the end
]


@pytest.mark.parametrize(("text", "expected"), REPLIES)
def test_the_parser_gives_the_same_content_calls_and_deltas_wherever_the_text_is_cut(text, expected):
    assert parse([text]) == expected
    for step in (1, 2, 3, 7):
        assert parse([text[i:i + step] for i in range(0, len(text), step)]) == expected
    for at in range(1, len(text)):
        assert parse(cuts(text, [at])) == expected, at


def test_every_two_cuts_of_a_call_after_content_give_the_same_pieces():
    text = "Sure.\n" + CALL
    for a, b in itertools.combinations(range(1, len(text)), 2):
        assert parse(cuts(text, [a, b])) == ["Sure.\n", PARIS], (a, b)


def test_a_calls_arguments_stream_as_the_model_writes_them():
    parser = ToolCallParser()
    assert parser.feed("Hi <tool") == ["Hi "]
    assert parser.feed('_call>\n{"name": "get_weather", "argu') == []  # its name is not known yet
    assert parser.feed('ments": {"city"') == [CallDelta(0, "get_weather", ""), CallDelta(0, "get_weather", '{"city"')]
    assert parser.feed(': "Paris"}') == [CallDelta(0, "get_weather", ': "Paris"')]  # a } may be the call's own end
    assert parser.feed("}\n</tool") == [CallDelta(0, "get_weather", "}")]
    assert parser.feed("_call>") == [PARIS]
    assert json.loads(PARIS.arguments) == {"city": "Paris"}


def test_content_that_might_open_a_call_is_held_until_it_does_not():
    parser = ToolCallParser()
    assert parser.feed("a <tool") == ["a "]
    assert parser.feed("s") == ["<tools"]


def test_a_forced_opening_parses_with_what_the_model_writes_after_it():
    text = call_opening("get_weather") + '{"city": "Paris"}}\n</tool_call>'
    assert parse(cuts(text, [len(call_opening("get_weather"))])) == [PARIS]
    assert parse([call_opening(None), CALL[len("<tool_call>\n"):]]) == [PARIS]


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
