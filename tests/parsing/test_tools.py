"""validate_tools: bad tool definitions and tool_choice values are a 400's message."""

from __future__ import annotations

import pytest

from freetoken.parsing.tools import validate_tools
from tests.parsing.support import TOOLS, tool


@pytest.mark.parametrize("tools,choice,error", [
    (TOOLS, "auto", None),
    (TOOLS, None, None),
    (TOOLS, "none", None),
    ([], "none", None),
    (None, "auto", None),
    (TOOLS, "required", None),
    (TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None),
    ([], "required", "required"),
    ([], {"type": "function", "function": {"name": "get_weather"}}, "not among"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among"),
    (TOOLS, {"type": "function", "function": {}}, "name"),
    (TOOLS, {"type": "function"}, "name"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "auto"}, "tool_choice"),
    ([{"type": "function", "function": {"parameters": {}}}], "auto", "name"),
    ([{"type": "function", "function": {"name": ""}}], "auto", "name"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "auto", "type"),
    ([{"function": {"name": "f"}}], "auto", "type"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "auto", "parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": None}}], "auto", None),
    ([tool("f"), tool("f")], "auto", "duplicate"),
])
def test_validate_tools(tools, choice, error):
    got = validate_tools(tools, choice)
    if error is None:
        assert got is None
    else:
        assert got is not None and error in got
