"""Tool definitions shared by the parsing tests."""

from __future__ import annotations


def tool(name: str, **props: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object", "properties": props}}}


TOOLS = [
    tool("get_weather", city={"type": "string"}, days={"type": "integer"}, metric={"type": "boolean"}),
    tool("write_file", path={"type": "string"}, content={"type": "string"}),
    tool("configure", ratio={"type": "number"}, opts={"type": "object"}, tags={"type": "array"},
         limit={"type": ["integer", "null"]}, note={"type": ["string", "null"]}),
]
