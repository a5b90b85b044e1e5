"""Reading a JSON object as it streams: its complete members, a stable prefix of its
re-serialized form, and where a block holding it ends (hermes, Harmony and mistral calls)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")


def dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def object_json(
    members: list[tuple[str, Any]], open_part: str | None = None, closed: bool = False
) -> str:
    """``{"k": v, ...`` with ``open_part`` (a member still arriving) last; '}' if closed."""
    parts = [f"{dump(k)}: {dump(v)}" for k, v in members]
    if open_part is not None:
        parts.append(open_part)
    return "{" + ", ".join(parts) + ("}" if closed else "")


def skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()  # type: ignore[union-attr]


@dataclass
class ObjectScan:
    members: list[tuple[str, Any, int]]  # (key, value, where the value starts)
    open_key: str | None = None  # the member whose value is still arriving
    open_at: int = -1
    end: int | None = None  # just past the closing brace
    after: int = 0  # just past the last complete member's value, or the opening brace


def scan_object(text: str, i: int, final: bool) -> ObjectScan:
    """Complete members of the JSON object opening at ``text[i]``.

    A member counts once the ',' or '}' after it has arrived, so a number still
    streaming ("12" of "123") is never taken early; when ``final`` (the text is all
    there will be) a value running up to the end counts too.
    """
    scan = ObjectScan([], after=i + 1)
    pos = skip_ws(text, i + 1)
    if text.startswith("}", pos):
        scan.end = pos + 1
        return scan
    while pos < len(text) and text[pos] == '"':
        try:
            key, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return scan
        pos = skip_ws(text, pos)
        if not text.startswith(":", pos):
            return scan
        start = skip_ws(text, pos + 1)
        scan.open_key, scan.open_at = key, start
        try:
            value, pos = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            return scan
        value_end, pos = pos, skip_ws(text, pos)
        if pos == len(text) and final:
            scan.members.append((key, value, start))
            scan.open_key, scan.after = None, value_end
            return scan
        if pos == len(text) or text[pos] not in ",}":
            return scan
        scan.members.append((key, value, start))
        scan.open_key, scan.after = None, value_end
        if text[pos] == "}":
            scan.end = pos + 1
            return scan
        pos = skip_ws(text, pos + 1)
    return scan


def args_json(text: str, start: int, final: bool) -> tuple[str, int | None]:
    """Stable prefix of the arguments JSON for the object at ``text[start]``, and
    where that object ends (None while open).

    An object cut short (``final`` and never closed) is left open as generated: its complete
    members as streamed so far, then the text after them as it stands, so a client sees a
    truncated call rather than a valid-looking smaller one. Its last value counts as complete
    only once a ',' follows, as while streaming, so what was streamed stays a prefix.
    """
    scan = scan_object(text, start, False)
    members = [(k, v) for k, v, _ in scan.members]
    if scan.end is None and final:
        return object_json(members) + text[scan.after :], None
    return object_json(members, closed=scan.end is not None), scan.end


def json_block_end(
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


def call_arguments(body: str, scan: ObjectScan, settled: bool) -> str:
    """A call object's arguments JSON (hermes, mistral): `"arguments"` or `"parameters"`, an
    object or one sent as a JSON string; "" while none has begun."""
    for key, value, start in scan.members:
        if key in ("arguments", "parameters"):
            if body.startswith("{", start):
                return args_json(body, start, True)[0]
            if isinstance(value, str):  # arguments sent as a JSON string
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    pass
            if isinstance(value, dict):
                return object_json(list(value.items()), closed=True)
            return dump(value)
    if scan.open_key in ("arguments", "parameters") and body.startswith("{", scan.open_at):
        return args_json(body, scan.open_at, settled)[0]
    return ""
