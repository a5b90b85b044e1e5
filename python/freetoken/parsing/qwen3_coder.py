"""Qwen3-Coder tool calls: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...``,
values typed by the tool's JSON schema."""

from __future__ import annotations

import ast
import json
from typing import Any

from freetoken.parsing.calls import DONE, PENDING, TEXT, CallScan, Detector
from freetoken.parsing.json_args import dump, object_json, skip_ws
from freetoken.parsing.stage import find_first, partial_suffix_len


class Qwen3CoderDetector(Detector):
    """``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nvalue\\n</parameter>\\n``
    ``</function>\\n</tool_call>``.

    The wrapper is optional. One leading and one trailing newline are trimmed per
    value; values are typed by the tool's schema. String values stream as they
    arrive; typed ones are sent when their ``</parameter>`` comes.
    """

    WRAP_OPEN, WRAP_CLOSE = "<tool_call>", "</tool_call>"
    FUNC, FUNC_CLOSE = "<function=", "</function>"
    PARAM, PARAM_CLOSE = "<parameter=", "</parameter>"
    start_markers = (WRAP_OPEN, FUNC)

    def scan_call(self, text: str, final: bool) -> CallScan:
        wrapped = text.startswith(self.WRAP_OPEN)
        pos = skip_ws(text, len(self.WRAP_OPEN)) if wrapped else 0
        if not text.startswith(self.FUNC, pos):
            if self.FUNC.startswith(text[pos:]) and not final:
                return CallScan(PENDING)
            return CallScan(TEXT, consumed=len(self.WRAP_OPEN))
        gt = text.find(">", pos + len(self.FUNC))
        if gt < 0:
            return CallScan(TEXT, consumed=len(text)) if final else CallScan(PENDING)
        name = text[pos + len(self.FUNC) : gt].strip()
        tags = (self.PARAM, self.FUNC_CLOSE) + ((self.WRAP_CLOSE,) if wrapped else ())
        value_ends = (self.PARAM_CLOSE, *tags)
        # A trailing newline may be the one trimmed before a closing tag: hold it too.
        holds = value_ends + tuple("\n" + t for t in value_ends)
        members: list[tuple[str, Any]] = []
        pos = gt + 1
        while True:
            i, tag = find_first(text, tags, pos)
            if tag == self.PARAM and (key_end := text.find(">", i + len(tag))) >= 0:
                key = text[i + len(tag) : key_end].strip()
                schema = self.param_schema(name, key)
                j, end_tag = find_first(text, value_ends, key_end + 1)
                if end_tag is None:
                    raw = text[key_end + 1 :]
                    raw = raw[: len(raw) - partial_suffix_len(raw, value_ends if final else holds)]
                    if not final:
                        return CallScan(PENDING, name, self._open_json(members, key, raw, schema))
                    members.append((key, convert_param_value(_trim(raw), schema)))
                    return CallScan(DONE, name, object_json(members, closed=True), len(text))
                members.append((key, convert_param_value(_trim(text[key_end + 1 : j]), schema)))
                pos = j + len(end_tag) if end_tag == self.PARAM_CLOSE else j
            elif tag in (self.FUNC_CLOSE, self.WRAP_CLOSE):
                end = i + len(tag)
                if wrapped and tag == self.FUNC_CLOSE:
                    after = skip_ws(text, end)
                    if text.startswith(self.WRAP_CLOSE, after):
                        end = after + len(self.WRAP_CLOSE)
                    elif self.WRAP_CLOSE.startswith(text[after:]):
                        if not final:
                            return CallScan(PENDING, name, object_json(members))
                        end = len(text)
                return CallScan(DONE, name, object_json(members, closed=True), end)
            elif final:  # truncated between parameters or inside a tag
                return CallScan(DONE, name, object_json(members, closed=True), len(text))
            else:
                return CallScan(PENDING, name, object_json(members))

    @staticmethod
    def _open_json(members: list[tuple[str, Any]], key: str, raw: str, schema: dict | None) -> str:
        value = raw[1:] if raw.startswith("\n") else raw
        part = f"{dump(key)}: "
        if _is_plain_string(schema):
            part += '"' + dump(value)[1:-1]  # char-wise escaping keeps this a prefix
        return object_json(members, part)


def _trim(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        declared = [declared]
    types = set(declared) if isinstance(declared, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= schema_types(sub)
    return types


def _is_plain_string(schema: Any) -> bool:
    return schema_types(schema) <= {"string"}


def convert_param_value(raw: str, schema: dict | None) -> Any:
    """Type a raw qwen3_coder parameter value by its JSON schema; undeclared stays a string."""
    types = schema_types(schema)
    if types <= {"string"}:
        return raw
    text = raw.strip()
    if text.lower() == "null" and ("null" in types or "string" not in types):
        return None
    if "integer" in types:
        try:
            return int(text)
        except ValueError:
            pass
    if "number" in types:
        try:
            number = json.loads(text)
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                return number
        except json.JSONDecodeError:
            pass
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if types & {"object", "array"}:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
        try:  # models sometimes write Python literals: {'a': True}
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return raw
