"""Hermes tool calls (also Qwen2.5's):
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

from __future__ import annotations

import json

from freetoken.parsing.calls import DONE, PENDING, TEXT, CallScan, Detector
from freetoken.parsing.json_args import ObjectScan, args_json, dump, json_block_end, object_json
from freetoken.parsing.json_args import scan_object, skip_ws


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
        args = self._arguments(body, scan, settled)
        close_len = len(self.CLOSE)
        end = json_block_end(text, body_end, scan.end, close_at, close_len, (self.CLOSE,), final)
        if end is None:
            return CallScan(PENDING, name, args)
        if name is None:
            return CallScan(TEXT, consumed=end)
        # "{}" stands for a closed call's missing arguments; a call cut before them has none yet.
        cut = close_at < 0 and scan.end is None
        return CallScan(DONE, name, args or ("" if cut else "{}"), end)

    @staticmethod
    def _arguments(body: str, scan: ObjectScan, settled: bool) -> str:
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
