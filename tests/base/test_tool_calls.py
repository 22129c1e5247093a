"""Tool definitions (services/base/tool_calls.py): each refusal names the field. The parser of the
calls is the thinker's: tests/thinker/test_tool_calls.py."""

from __future__ import annotations

import pytest

from services.base.errors import InvalidArgument
from services.base.tool_calls import check_tool, check_tools


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
