"""Hermes tool calls (also Qwen2.5's):
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

from __future__ import annotations

from freetoken.parsing.calls import DONE, PENDING, TEXT, CallScan, Detector
from freetoken.parsing.json_args import call_arguments, json_block_end, scan_object, skip_ws


class HermesDetector(Detector):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    ``"parameters"`` is accepted for ``"arguments"``, and so are arguments sent as a JSON
    string. ``</tool_call>`` always ends the block, even around broken JSON.
    """

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    start_markers = (OPEN,)

    def scan_call(self, text: str, final: bool) -> CallScan:
        close_at = text.find(self.CLOSE, len(self.OPEN))
        body_end = close_at if close_at >= 0 else len(text)
        body = text[:body_end]
        settled = final or close_at >= 0
        p = skip_ws(body, len(self.OPEN))
        if p == len(body) and not settled:
            return CallScan(PENDING)
        if p == len(body) or body[p] != "{":
            return CallScan(TEXT, consumed=len(self.OPEN))
        scan = scan_object(body, p, settled)
        name = next((v for k, v, _ in scan.members if k == "name" and isinstance(v, str)), None)
        args = call_arguments(body, scan, settled)
        close_len = len(self.CLOSE)
        end = json_block_end(text, body_end, scan.end, close_at, close_len, (self.CLOSE,), final)
        if end is None:
            return CallScan(PENDING, name, args)
        if name is None:
            return CallScan(TEXT, consumed=end)
        # "{}" stands for a closed call's missing arguments; a call cut before them has none yet.
        cut = close_at < 0 and scan.end is None
        return CallScan(DONE, name, args or ("" if cut else "{}"), end)
