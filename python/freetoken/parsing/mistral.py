"""Mistral tool calls (`mistral`, vLLM's name): ``[TOOL_CALLS]`` then a JSON array of
``{"name": ..., "arguments": {...}}`` (v3-v7 tokenizers: Mistral 7B v0.3, Nemo, Small 3.1), or
one ``[TOOL_CALLS]NAME[ARGS]{...}`` per call (v11+: Small 3.2, Magistral, Ministral 3, Devstral;
v11 writes ``[CALL_ID]ID`` before ``[ARGS]``)."""

from __future__ import annotations

import re
import secrets
import string

from freetoken.parsing.call_list import CallListDetector
from freetoken.parsing.calls import DONE, PENDING, TEXT, CallScan
from freetoken.parsing.json_args import args_json, skip_ws

_NAME = re.compile(r"[A-Za-z0-9_-]*")
_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's templates refuse a tool-call id that is not 9 alphanumeric characters."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


class MistralDetector(CallListDetector):
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (the JSON list that granite and
    phi4_mini_json share) or ``[TOOL_CALLS]NAME[ARGS]{...}`` (``[CALL_ID]ID`` before ``[ARGS]``
    skipped; a bare ``NAME{...}`` too). A named call ends with its arguments' object; text
    after it is text.
    """

    BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    start_markers = (BOT,)

    def not_a_list(self, text: str, head: int, p: int, final: bool) -> CallScan:
        return self._named(text, p, final)

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
