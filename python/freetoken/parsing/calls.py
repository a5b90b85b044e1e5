"""The tool-call stage, shared by every call format.

A detector knows one call format and answers a single question: given the text of one call
block so far, what is known (name, a stable prefix of the arguments JSON) and where does the
block end. ``CallStream`` does everything else once for all formats: finding openers, holding
back partial openers, the whitespace rule, and turning the growing knowledge into
``ToolCallItem`` deltas. Detectors only decide on text they have seen completely, so any
chunking gives the same calls.

Arguments are always re-serialized as ``{"k": v, ...}`` with ``json.dumps``
(``ensure_ascii=False``), built member by member so every streamed fragment is a prefix of the
final string. Unknown function names are forwarded as calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.parsing.stage import Label, Stage, find_first, partial_suffix_len


@dataclass
class ToolCallItem:
    """Streaming: the first item of a call has its name and "", later ones argument
    fragments. Joined per ``tool_index``: one item per call with the whole arguments JSON."""

    tool_index: int
    name: str | None = None
    parameters: str = ""  # a fragment of the arguments JSON when streaming


PENDING, DONE, TEXT = "pending", "done", "text"


@dataclass
class CallScan:
    """What a detector can tell from one call block so far."""

    status: str  # PENDING: need more text; DONE: a call; TEXT: not a call after all
    name: str | None = None
    args: str = ""  # a prefix of the final arguments JSON that later text cannot change
    consumed: int = 0  # DONE: length of the block; TEXT: length to release as plain text


class Detector:
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


class CallStream(Stage):
    """Normal text (CONTENT, or HIDDEN where stripped) and call blocks (TOOL, with items)."""

    leftover = Label.TOOL  # detectors settle when final; nothing is expected here

    def __init__(self, detector: Detector) -> None:
        super().__init__()
        self.detector = detector
        self._strip = True  # leading whitespace of the turn and after each call is dropped
        self.in_call = False
        self.index = 0
        self.name_sent = False
        self.args_sent = ""

    def _run(self, final: bool) -> None:
        while True:
            if not self.in_call:
                start = self.detector.find_start(self.tape.text)
                if start < 0:
                    markers = self.detector.start_markers
                    keep = 0 if final else partial_suffix_len(self.tape.text, markers)
                    self._emit(len(self.tape.text) - keep, Label.CONTENT)
                    return
                self._emit(start, Label.CONTENT)
                self.in_call = True
            scan = self.detector.scan_call(self.tape.text, final)
            if scan.status == TEXT:
                # NOTE: detectors only give up before a name was known, so nothing is retracted.
                self._emit(scan.consumed, Label.CONTENT)
                self.in_call = False
                continue
            if scan.name is not None:
                if not self.name_sent:
                    self._calls.append(ToolCallItem(self.index, scan.name, ""))
                    self.name_sent = True
                fresh = scan.args[len(self.args_sent) :]
                if fresh:
                    self._calls.append(ToolCallItem(self.index, None, fresh))
                    self.args_sent = scan.args
            if scan.status == PENDING:
                return
            self._consume(scan.consumed, Label.TOOL)
            self.in_call, self.name_sent, self.args_sent, self._strip = False, False, "", True
            self.index += 1
