"""Request-side checks of ``tools`` and ``tool_choice`` (a 400 before anything is generated)."""

from __future__ import annotations

from typing import Any


def validate_tools(tools: list[dict] | None, tool_choice: Any) -> str | None:
    """An error message for bad tool definitions or a tool_choice they cannot satisfy."""
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return f"tools[{i}].type must be 'function'"
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"tools[{i}].function.name is required"
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            return f"tools[{i}].function.parameters must be a JSON schema object"
        if fn["name"] in names:
            return f"duplicate tool name {fn['name']!r}"
        names.add(fn["name"])
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        return None if names else "tool_choice 'required' needs at least one tool"
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        chosen = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(chosen, str):
            return "tool_choice.function.name is required"
        if chosen not in names:
            return f"tool_choice names {chosen!r}, which is not among the tools"
        return None
    return (
        "tool_choice must be 'none', 'auto', 'required' "
        "or {'type': 'function', 'function': {'name': ...}}"
    )
