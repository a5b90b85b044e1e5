"""Extract tool calls from model content, streamed or in one piece.

A detector knows one call format and answers a single question: given the text of
one call block so far, what is known (name, a stable prefix of the arguments JSON)
and where does the block end. ``_CallStream`` does everything else once for all
formats: finding openers, holding back partial openers, the whitespace rule, and
turning the growing knowledge into ``ToolCallItem`` deltas. ``parse_non_stream``
runs a fresh stream over the whole text, so both paths agree for any chunking as
long as detectors only decide on text they have seen completely.

Arguments are always re-serialized as ``{"k": v, ...}`` with ``json.dumps``
(``ensure_ascii=False``), built member by member so every streamed fragment is a
prefix of the final string. Unknown function names are forwarded as calls.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from freetoken.server.reasoning_parser import find_first, partial_suffix_len


@dataclass
class ToolCallItem:
    """Streaming: the first item of a call has its name and "", later ones argument
    fragments. Non-streaming: one item per call with the whole arguments JSON."""

    tool_index: int
    name: str | None = None
    parameters: str = ""  # a fragment of the arguments JSON when streaming


@dataclass
class StreamingParseResult:
    normal_text: str = ""
    calls: list[ToolCallItem] = field(default_factory=list)


PENDING, DONE, TEXT = "pending", "done", "text"


@dataclass
class CallScan:
    """What a detector can tell from one call block so far."""

    status: str  # PENDING: need more text; DONE: a call; TEXT: not a call after all
    name: str | None = None
    args: str = ""  # a prefix of the final arguments JSON that later text cannot change
    consumed: int = 0  # DONE: length of the block; TEXT: length to release as plain text


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _object_json(
    members: list[tuple[str, Any]], open_part: str | None = None, closed: bool = False
) -> str:
    """``{"k": v, ...`` with ``open_part`` (a member still arriving) last; '}' if closed."""
    parts = [f"{_dump(k)}: {_dump(v)}" for k, v in members]
    if open_part is not None:
        parts.append(open_part)
    return "{" + ", ".join(parts) + ("}" if closed else "")


# ---------------------------------------------------------------- JSON bodies

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")


def _skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()  # type: ignore[union-attr]


@dataclass
class _ObjectScan:
    members: list[tuple[str, Any, int]]  # (key, value, where the value starts)
    open_key: str | None = None  # the member whose value is still arriving
    open_at: int = -1
    end: int | None = None  # just past the closing brace


def _scan_object(text: str, i: int, final: bool) -> _ObjectScan:
    """Complete members of the JSON object opening at ``text[i]``.

    A member counts once the ',' or '}' after it has arrived, so a number still
    streaming ("12" of "123") is never taken early; when ``final`` (the text is all
    there will be) a value running up to the end counts too.
    """
    scan = _ObjectScan([])
    pos = _skip_ws(text, i + 1)
    if text.startswith("}", pos):
        scan.end = pos + 1
        return scan
    while pos < len(text) and text[pos] == '"':
        try:
            key, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return scan
        pos = _skip_ws(text, pos)
        if not text.startswith(":", pos):
            return scan
        start = _skip_ws(text, pos + 1)
        scan.open_key, scan.open_at = key, start
        try:
            value, pos = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            return scan
        pos = _skip_ws(text, pos)
        if pos == len(text) and final:
            scan.members.append((key, value, start))
            scan.open_key = None
            return scan
        if pos == len(text) or text[pos] not in ",}":
            return scan
        scan.members.append((key, value, start))
        scan.open_key = None
        if text[pos] == "}":
            scan.end = pos + 1
            return scan
        pos = _skip_ws(text, pos + 1)
    return scan


def _args_json(text: str, start: int, final: bool) -> tuple[str, int | None]:
    """Stable prefix of the arguments JSON for the object at ``text[start]``, and
    where that object ends (None while open)."""
    scan = _scan_object(text, start, final)
    members = [(k, v) for k, v, _ in scan.members]
    return _object_json(members, closed=scan.end is not None or final), scan.end


def _json_block_end(
    text: str,
    body_end: int,
    obj_end: int | None,
    close_at: int,
    close_len: int,
    markers: tuple[str, ...],
    final: bool,
) -> int | None:
    """Where a block holding one JSON object ends, or None while undecided.

    ``close_at`` is the first closing marker (-1 if none yet); the object was scanned
    only up to it, so a closer always ends the block, also around broken JSON.
    """
    if obj_end is not None:
        tail = text[obj_end:body_end].lstrip()
        if tail and not (close_at < 0 and any(m.startswith(tail) for m in markers)):
            return obj_end  # text after the object that is no closer belongs to the reply
    if close_at >= 0:
        return close_at + close_len
    return len(text) if final else None


# ---------------------------------------------------------------- detectors


class BaseFormatDetector:
    start_markers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None) -> None:
        self.tools = tools or []
        self._params: dict[str, dict] = {}  # function name -> its parameters' properties
        for tool in self.tools:
            fn = tool.get("function") or {}
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            self._params[fn.get("name", "")] = props if isinstance(props, dict) else {}

    def find_start(self, text: str) -> int:
        return find_first(text, self.start_markers)[0]

    def scan_call(self, text: str, final: bool) -> CallScan:
        """``text`` starts with one of ``start_markers``; ``final``: no more text comes."""
        raise NotImplementedError

    def param_schema(self, function: str, key: str) -> dict | None:
        return self._params.get(function, {}).get(key)


class Qwen25Detector(BaseFormatDetector):
    """Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    start_markers = (OPEN,)

    def scan_call(self, text: str, final: bool) -> CallScan:
        close_at = text.find(self.CLOSE, len(self.OPEN))
        body_end = close_at if close_at >= 0 else len(text)
        body = text[:body_end]
        settled = final or close_at >= 0
        p = _skip_ws(body, len(self.OPEN))
        if p == len(body) and not settled:
            return CallScan(PENDING)
        if p == len(body) or body[p] != "{":
            return CallScan(TEXT, consumed=len(self.OPEN))
        scan = _scan_object(body, p, settled)
        name = next((v for k, v, _ in scan.members if k == "name" and isinstance(v, str)), None)
        args = self._arguments(body, scan, settled)
        close_len = len(self.CLOSE)
        end = _json_block_end(text, body_end, scan.end, close_at, close_len, (self.CLOSE,), final)
        if end is None:
            return CallScan(PENDING, name, args)
        if name is None:
            return CallScan(TEXT, consumed=end)
        return CallScan(DONE, name, args or "{}", end)

    @staticmethod
    def _arguments(body: str, scan: _ObjectScan, settled: bool) -> str:
        for key, value, start in scan.members:
            if key in ("arguments", "parameters"):
                if body.startswith("{", start):
                    return _args_json(body, start, True)[0]
                if isinstance(value, str):  # arguments sent as a JSON string
                    try:
                        value = json.loads(value)
                    except json.JSONDecodeError:
                        pass
                if isinstance(value, dict):
                    return _object_json(list(value.items()), closed=True)
                return _dump(value)
        if scan.open_key in ("arguments", "parameters") and body.startswith("{", scan.open_at):
            return _args_json(body, scan.open_at, settled)[0]
        return ""


class HarmonyDetector(BaseFormatDetector):
    """gpt-oss Harmony: ``[<|start|>assistant]<|channel|>commentary to=functions.NAME
    [<|constrain|>json]<|message|>{...}<|call|>``.

    The block ends at ``<|call|>``/``<|end|>``/``<|return|>``, or just before the next
    ``<|start|>``/``<|channel|>``. A body that is not a JSON object is passed on as
    the raw arguments string.
    """

    MESSAGE = "<|message|>"
    CLOSERS = ("<|call|>", "<|end|>", "<|return|>")
    start_markers = ("<|start|>", "<|channel|>")
    _RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")

    def scan_call(self, text: str, final: bool) -> CallScan:
        opener = next(m for m in self.start_markers if text.startswith(m))
        m, marker = find_first(text, (self.MESSAGE, *self.CLOSERS), len(opener))
        if marker is None and not final:
            return CallScan(PENDING)
        recipient = self._RECIPIENT.search(text, 0, m) if marker == self.MESSAGE else None
        if recipient is None:
            return CallScan(TEXT, consumed=len(opener))
        name = recipient.group(1)
        body_start = m + len(self.MESSAGE)
        close_at, closer = find_first(text, (*self.CLOSERS, *self.start_markers), body_start)
        close_len = len(closer) if closer in self.CLOSERS else 0
        body_end = close_at if close_at >= 0 else len(text)
        settled = final or close_at >= 0
        p = _skip_ws(text, body_start)
        if p < body_end and text[p] != "{":
            if not settled:
                return CallScan(PENDING, name)
            return CallScan(DONE, name, text[p:body_end].strip(), body_end + close_len)
        body = text[:body_end]
        args, obj_end = _args_json(body, p, settled) if p < body_end else ("", None)
        markers = (*self.CLOSERS, *self.start_markers)
        end = _json_block_end(text, body_end, obj_end, close_at, close_len, markers, final)
        if end is None:
            return CallScan(PENDING, name, args)
        return CallScan(DONE, name, args or "{}", end)


class Qwen3CoderDetector(BaseFormatDetector):
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
        pos = _skip_ws(text, len(self.WRAP_OPEN)) if wrapped else 0
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
                    return CallScan(DONE, name, _object_json(members, closed=True), len(text))
                members.append((key, convert_param_value(_trim(text[key_end + 1 : j]), schema)))
                pos = j + len(end_tag) if end_tag == self.PARAM_CLOSE else j
            elif tag in (self.FUNC_CLOSE, self.WRAP_CLOSE):
                end = i + len(tag)
                if wrapped and tag == self.FUNC_CLOSE:
                    after = _skip_ws(text, end)
                    if text.startswith(self.WRAP_CLOSE, after):
                        end = after + len(self.WRAP_CLOSE)
                    elif self.WRAP_CLOSE.startswith(text[after:]):
                        if not final:
                            return CallScan(PENDING, name, _object_json(members))
                        end = len(text)
                return CallScan(DONE, name, _object_json(members, closed=True), end)
            elif final:  # truncated between parameters or inside a tag
                return CallScan(DONE, name, _object_json(members, closed=True), len(text))
            else:
                return CallScan(PENDING, name, _object_json(members))

    @staticmethod
    def _open_json(members: list[tuple[str, Any]], key: str, raw: str, schema: dict | None) -> str:
        value = raw[1:] if raw.startswith("\n") else raw
        part = f"{_dump(key)}: "
        if _is_plain_string(schema):
            part += '"' + _dump(value)[1:-1]  # char-wise escaping keeps this a prefix
        return _object_json(members, part)


def _trim(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        declared = [declared]
    types = set(declared) if isinstance(declared, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= _schema_types(sub)
    return types


def _is_plain_string(schema: Any) -> bool:
    return _schema_types(schema) <= {"string"}


def convert_param_value(raw: str, schema: dict | None) -> Any:
    """Type a raw qwen3_coder parameter value by its JSON schema; undeclared stays a string."""
    types = _schema_types(schema)
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


# ---------------------------------------------------------------- the parser

SUPPORTED_TOOL_CALL_PARSERS: dict[str, type[BaseFormatDetector]] = {
    "hermes": Qwen25Detector,
    "qwen25": Qwen25Detector,
    "qwen": Qwen25Detector,
    "qwen3_coder": Qwen3CoderDetector,
    "gpt_oss": HarmonyDetector,
}

# Cheap pre-filter: content holding none of these has no tool call in any format.
TOOLS_TAG_LIST = sorted({m for d in SUPPORTED_TOOL_CALL_PARSERS.values() for m in d.start_markers})


class _CallStream:
    def __init__(self, detector: BaseFormatDetector) -> None:
        self.detector = detector
        self.buf = ""
        self.in_call = False
        self.strip = True  # leading whitespace of the turn and after each call is dropped
        self.index = 0
        self.name_sent = False
        self.args_sent = ""

    def feed(self, text: str, final: bool) -> StreamingParseResult:
        self.buf += text
        out = StreamingParseResult()
        while True:
            if not self.in_call:
                start = self.detector.find_start(self.buf)
                if start < 0:
                    keep = 0 if final else partial_suffix_len(self.buf, self.detector.start_markers)
                    self._text(out, len(self.buf) - keep)
                    return out
                self._text(out, start)
                self.in_call = True
            scan = self.detector.scan_call(self.buf, final)
            if scan.status == TEXT:
                # NOTE: detectors only give up before a name was known, so nothing is retracted.
                self._text(out, scan.consumed)
                self.in_call = False
                continue
            if scan.name is not None:
                if not self.name_sent:
                    out.calls.append(ToolCallItem(self.index, scan.name, ""))
                    self.name_sent = True
                fresh = scan.args[len(self.args_sent) :]
                if fresh:
                    out.calls.append(ToolCallItem(self.index, None, fresh))
                    self.args_sent = scan.args
            if scan.status == PENDING:
                return out
            self.buf = self.buf[scan.consumed :]
            self.in_call, self.name_sent, self.args_sent, self.strip = False, False, "", True
            self.index += 1

    def _text(self, out: StreamingParseResult, n: int) -> None:
        text, self.buf = self.buf[:n], self.buf[n:]
        if self.strip:
            text = text.lstrip()
            self.strip = not text
        out.normal_text += text


class FunctionCallParser:
    """Tool-call extraction for one generation; ``tools`` are OpenAI tool dicts."""

    def __init__(self, tools: list[dict], tool_call_parser: str) -> None:
        if tool_call_parser not in SUPPORTED_TOOL_CALL_PARSERS:
            raise ValueError(
                f"unknown tool call parser {tool_call_parser!r}; "
                f"choose one of {sorted(SUPPORTED_TOOL_CALL_PARSERS)}"
            )
        self.tools = tools
        self.tool_call_parser = tool_call_parser
        self.detector = SUPPORTED_TOOL_CALL_PARSERS[tool_call_parser](tools)
        self._stream = _CallStream(self.detector)

    def has_tool_call(self, text: str) -> bool:
        return self.detector.find_start(text) >= 0

    def parse_stream_chunk(self, text: str) -> StreamingParseResult:
        return self._stream.feed(text, final=False)

    def finish_stream(self) -> StreamingParseResult:
        """End of stream: held text comes out, a call cut short is closed (or, if its
        name never arrived, given back as text)."""
        return self._stream.feed("", final=True)

    def parse_non_stream(self, text: str) -> StreamingParseResult:
        """One ``ToolCallItem`` per call with its full arguments; stream state untouched."""
        result = _CallStream(self.detector).feed(text, final=True)
        calls: dict[int, ToolCallItem] = {}
        for item in result.calls:
            call = calls.setdefault(item.tool_index, ToolCallItem(item.tool_index))
            call.name = item.name if item.name is not None else call.name
            call.parameters += item.parameters
        return StreamingParseResult(result.normal_text, list(calls.values()))


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
