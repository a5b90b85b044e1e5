"""Tool calls as an opener and then a JSON list of ``{"name": ..., "arguments": {...}}``: the
layout Mistral's v3-v7 tokenizers (``[TOOL_CALLS]``), IBM's Granite 3.x (``<|tool_call|>``,
vLLM's `granite`) and Microsoft's Phi-4-mini (``functools``, vLLM's `phi4_mini_json`) share."""

from __future__ import annotations

from freetoken.parsing.calls import DONE, PENDING, TEXT, CallScan, Detector
from freetoken.parsing.json_args import call_arguments, scan_object, skip_ws


class CallListDetector(Detector):
    """An opener of ``start_markers``, then ``[{"name": ..., "arguments": {...}}, ...]``.

    Each element of the list is one call: after its object, a ``,`` continues the list and
    ``]`` ends it. Elements read as hermes's objects (``"parameters"`` and arguments as a JSON
    string accepted, other keys ignored). An opener not followed by a list stays text
    (``not_a_list`` may read another layout there).
    """

    def __init__(self, tools: list[dict] | None) -> None:
        super().__init__(tools)
        self._in_list = False  # a list element ended with ",": the next call is its next

    def find_start(self, text: str) -> int:
        if self._in_list:
            p = skip_ws(text, 0)
            return p if p < len(text) else -1
        return super().find_start(text)

    def scan_call(self, text: str, final: bool) -> CallScan:
        if self._in_list:
            return self._element(text, 0, 0, final)
        head = len(next(m for m in self.start_markers if text.startswith(m)))
        p = skip_ws(text, head)
        if p == len(text):
            return CallScan(TEXT, consumed=head) if final else CallScan(PENDING)
        if text[p] != "[":
            return self.not_a_list(text, head, p, final)
        q = skip_ws(text, p + 1)
        if q == len(text) and not final:
            return CallScan(PENDING)
        return self._element(text, q, head, final)

    def not_a_list(self, text: str, head: int, p: int, final: bool) -> CallScan:
        """``text[p]`` after the opener (``text[:head]``) is no ``[``."""
        return CallScan(TEXT, consumed=head)

    def _element(self, text: str, start: int, head: int, final: bool) -> CallScan:
        """One object of the list at ``text[start]`` (``head``: the opener's length, 0 for a
        later element); the block runs through the ``,`` or ``]`` after it."""
        if not text.startswith("{", start):
            self._in_list = False  # a later element that is no object: text from there
            return CallScan(TEXT, consumed=head)
        scan = scan_object(text, start, final)
        name = next((v for k, v, _ in scan.members if k == "name" and isinstance(v, str)), None)
        args = call_arguments(text, scan, final)
        if scan.end is None:
            if not final:
                return CallScan(PENDING, name, args)
            self._in_list = False
            if name is None:
                return CallScan(TEXT, consumed=len(text))
            return CallScan(DONE, name, args, len(text))  # cut short: as generated
        after = skip_ws(text, scan.end)
        if after == len(text) and not final:
            return CallScan(PENDING, name, args)
        self._in_list = text.startswith(",", after)
        end = after + 1 if text.startswith((",", "]"), after) else scan.end
        if name is None:
            self._in_list = False
            return CallScan(TEXT, consumed=end)
        return CallScan(DONE, name, args or "{}", end)


class GraniteDetector(CallListDetector):
    """Granite 3.x: ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`` (its templates
    ask for it; 3.0's writes an ``assistant_tool_call`` turn so). ``<tool_call>`` before the
    list is read too, as vLLM's `granite` reads Granite 3.1's."""

    start_markers = ("<|tool_call|>", "<tool_call>")


class Phi4MiniDetector(CallListDetector):
    """Phi-4-mini: ``functools[{"name": ..., "arguments": {...}}, ...]``, as vLLM's
    `phi4_mini_json` reads it (its ``examples/tool_chat_template_phi4_mini.jinja`` asks for
    it). ``functools`` is plain text there: one not followed by a list stays text."""

    start_markers = ("functools",)
