"""Mistral tool calls (`mistral`, vLLM's name): ``[TOOL_CALLS]`` then a JSON array of
``{"name": ..., "arguments": {...}}`` (v3-v7 tokenizers: Mistral 7B v0.3, Nemo, Small 3.1), or
one ``[TOOL_CALLS]NAME[ARGS]{...}`` per call (v11+: Small 3.2, Magistral, Ministral 3, Devstral;
v11 writes ``[CALL_ID]ID`` before ``[ARGS]``)."""

from __future__ import annotations

import re
import secrets
import string

from freetoken.parsing.calls import DONE, PENDING, TEXT, CallScan, Detector
from freetoken.parsing.json_args import args_json, call_arguments, scan_object, skip_ws

_NAME = re.compile(r"[A-Za-z0-9_-]*")
_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's templates refuse a tool-call id that is not 9 alphanumeric characters."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


class MistralDetector(Detector):
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` or
    ``[TOOL_CALLS]NAME[ARGS]{...}`` (``[CALL_ID]ID`` before ``[ARGS]`` skipped; a bare
    ``NAME{...}`` too).

    Each element of the array is one call: after its object, a ``,`` continues the array and
    ``]`` ends it. Array elements read as hermes's objects (``"parameters"`` and arguments as a
    JSON string accepted). A named call ends with its arguments' object; text after it is text.
    """

    BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    start_markers = (BOT,)

    def __init__(self, tools: list[dict] | None) -> None:
        super().__init__(tools)
        self._in_array = False  # an array element ended with ",": the next call is its next

    def find_start(self, text: str) -> int:
        if self._in_array:
            p = skip_ws(text, 0)
            return p if p < len(text) else -1
        return super().find_start(text)

    def scan_call(self, text: str, final: bool) -> CallScan:
        if self._in_array:
            return self._element(text, 0, final)
        p = skip_ws(text, len(self.BOT))
        if p == len(text):
            return CallScan(TEXT, consumed=len(self.BOT)) if final else CallScan(PENDING)
        if text[p] != "[":
            return self._named(text, p, final)
        q = skip_ws(text, p + 1)
        if q == len(text) and not final:
            return CallScan(PENDING)
        return self._element(text, q, final)

    def _element(self, text: str, start: int, final: bool) -> CallScan:
        """One object of the array at ``text[start]``; the block runs through the ``,`` or
        ``]`` after it."""
        if not text.startswith("{", start):
            self._in_array = False  # a later element that is no object: text from there
            return CallScan(TEXT, consumed=len(self.BOT) if start else 0)
        scan = scan_object(text, start, final)
        name = next((v for k, v, _ in scan.members if k == "name" and isinstance(v, str)), None)
        args = call_arguments(text, scan, final)
        if scan.end is None:
            if not final:
                return CallScan(PENDING, name, args)
            self._in_array = False
            if name is None:
                return CallScan(TEXT, consumed=len(text))
            return CallScan(DONE, name, args, len(text))  # cut short: as generated
        after = skip_ws(text, scan.end)
        if after == len(text) and not final:
            return CallScan(PENDING, name, args)
        self._in_array = text.startswith(",", after)
        end = after + 1 if text.startswith((",", "]"), after) else scan.end
        if name is None:
            self._in_array = False
            return CallScan(TEXT, consumed=end)
        return CallScan(DONE, name, args or "{}", end)

    def _named(self, text: str, p: int, final: bool) -> CallScan:
        """``NAME[ARGS]{...}`` from ``text[p]``; the name is sent once its arguments begin."""
        n = _NAME.match(text, p).end()  # type: ignore[union-attr]
        rest = text[n:]
        if rest.startswith(self.CALL_ID):
            k = text.find(self.ARGS, n)
            if k < 0:
                return CallScan(TEXT, consumed=len(self.BOT)) if final else CallScan(PENDING)
            at = k + len(self.ARGS)
        elif rest.startswith(self.ARGS):
            at = n + len(self.ARGS)
        elif rest.startswith("{"):
            at = n
        elif not final and (self.ARGS.startswith(rest) or self.CALL_ID.startswith(rest)):
            return CallScan(PENDING)
        else:
            return CallScan(TEXT, consumed=len(self.BOT))
        q = skip_ws(text, at)
        if n == p or (q == len(text) and final) or (q < len(text) and text[q] != "{"):
            return CallScan(TEXT, consumed=len(self.BOT))
        if q == len(text):
            return CallScan(PENDING)
        name = text[p:n]
        args, end = args_json(text, q, final)
        if end is None:
            return CallScan(DONE, name, args, len(text)) if final else CallScan(PENDING, name, args)
        return CallScan(DONE, name, args, end)
