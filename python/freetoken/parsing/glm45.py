"""GLM-4.5 (`glm45`, vLLM's name): reasoning in ``<think>`` ... ``</think>`` and tool calls as
``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>``."""

from __future__ import annotations

import ast
import json
from typing import Any

from freetoken.parsing.calls import DONE, PENDING, TEXT, CallScan, Detector
from freetoken.parsing.json_args import dump, object_json, skip_ws
from freetoken.parsing.qwen3 import ThinkSplitter
from freetoken.parsing.qwen3_coder import schema_types
from freetoken.parsing.stage import find_first, partial_suffix_len


class Glm45Splitter(ThinkSplitter):
    """qwen3's rules, except that the output's leading whitespace is dropped: GLM-4.5 writes
    ``\\n<think>`` after ``<|assistant|>``. Its template never opens the block itself (with
    ``enable_thinking: false`` it closes one, ``<think></think>``, in the prompt)."""

    strip_head = True


class Glm45Detector(Detector):
    """``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>``.

    The name runs to the first newline or tag; keys and values are stripped. A
    value whose parameter the tool's schema types as only ``string`` is text and streams as it
    arrives; any other (typed, undeclared, or of an unknown tool) is read as JSON, then as a
    Python literal, else kept as text, and is sent when its ``</arg_value>`` comes. A missing
    ``</arg_value>`` is tolerated: the next ``<arg_key>`` or ``</tool_call>`` ends the value.
    """

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
    start_markers = (OPEN,)

    def scan_call(self, text: str, final: bool) -> CallScan:
        head = len(self.OPEN)
        cut, tag = find_first(text, ("\n", "<"), head)
        if tag is None:
            return CallScan(TEXT, consumed=head) if final else CallScan(PENDING)
        name = text[head:cut].strip()
        if not name or any(c.isspace() or c in '{}<>"' for c in name):  # not a function name
            return CallScan(TEXT, consumed=head)
        value_ends = (self.VALUE_END, self.KEY, self.CLOSE)
        members: list[tuple[str, Any]] = []
        pos = cut + 1 if tag == "\n" else cut
        while True:
            i, tag = find_first(text, (self.KEY, self.CLOSE), pos)
            if tag == self.CLOSE:
                return CallScan(DONE, name, object_json(members, closed=True), i + len(tag))
            key_end = text.find(self.KEY_END, i) if tag == self.KEY else -1
            if key_end < 0:  # no key yet, or one still arriving
                if final:
                    return CallScan(DONE, name, object_json(members, closed=True), len(text))
                return CallScan(PENDING, name, object_json(members))
            key = text[i + len(self.KEY) : key_end].strip()
            v = skip_ws(text, key_end + len(self.KEY_END))
            if not text.startswith(self.VALUE, v):
                if self.VALUE.startswith(text[v:]) and not final:
                    return CallScan(PENDING, name, object_json(members))
                pos = v  # a key without a value: skipped
                continue
            schema = self.param_schema(name, key)
            start = v + len(self.VALUE)
            j, end_tag = find_first(text, value_ends, start)
            if end_tag is None:
                raw = text[start:]
                raw = raw[: len(raw) - partial_suffix_len(raw, value_ends)]
                if not final:
                    return CallScan(PENDING, name, self._open_json(members, key, raw, schema))
                members.append((key, glm_value(raw.strip(), schema)))
                return CallScan(DONE, name, object_json(members, closed=True), len(text))
            members.append((key, glm_value(text[start:j].strip(), schema)))
            pos = j + len(end_tag) if end_tag == self.VALUE_END else j

    @staticmethod
    def _open_json(members: list[tuple[str, Any]], key: str, raw: str, schema: Any) -> str:
        """The arguments so far with a string value still arriving: its stripped text, less
        trailing whitespace that may yet be stripped (char-wise escaping keeps it a prefix)."""
        if not _is_text(schema):
            return object_json(members)
        return object_json(members, f'{dump(key)}: "' + dump(raw.strip())[1:-1])


def _is_text(schema: Any) -> bool:
    return schema_types(schema) == {"string"}


def glm_value(raw: str, schema: Any) -> Any:
    """A stripped ``<arg_value>`` as vLLM's glm45 parser reads it: text when the parameter is
    only a string, else JSON, then JSON inside a JSON string (escaped quotes), then a Python
    literal, else the text itself."""
    if _is_text(schema):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        pass
    try:
        return json.loads(json.loads(f'"{raw}"'))
    except (json.JSONDecodeError, TypeError):
        pass
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw
