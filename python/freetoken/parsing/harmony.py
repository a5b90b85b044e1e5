"""OpenAI Harmony (gpt-oss): channels split reasoning from content, and messages addressed to
``functions.NAME`` are tool calls.

``[<|start|>ROLE]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY<|end|>``;
a message ends with ``<|end|>``, ``<|return|>`` or ``<|call|>``. ``HarmonySplitter`` routes the
bodies and passes a tool message on verbatim; ``HarmonyDetector`` reads the call out of it.
"""

from __future__ import annotations

import re

from freetoken.parsing.calls import DONE, PENDING, TEXT, CallScan, Detector
from freetoken.parsing.json_args import args_json, json_block_end, skip_ws
from freetoken.parsing.stage import Label, Stage, find_first, partial_suffix_len

_START, _CHANNEL, _MESSAGE, _CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
_END, _RETURN, _CALL = "<|end|>", "<|return|>", "<|call|>"
_CLOSERS = (_END, _RETURN, _CALL)
_OPENERS = (_START, _CHANNEL)
HARMONY_MARKERS = (*_OPENERS, _MESSAGE, _CONSTRAIN, *_CLOSERS)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")


class HarmonySplitter(Stage):
    """Channels to reasoning and content.

    - ``analysis`` bodies are reasoning; ``final``, ``commentary`` without a
      ``to=functions.*`` recipient, unknown channels and text outside any message
      are content. Bodies are verbatim; markers never reach either side.
    - A message addressed ``to=functions.NAME`` is passed to content verbatim, header
      and closer included, for the tool parser. One cut short by the next
      ``<|start|>``/``<|channel|>`` gets a ``<|call|>`` so the parser sees it closed.
    - ``force_reasoning``: the template already opened an analysis message.
    """

    leftover = Label.MARKER  # an unfinished header is never shown

    def __init__(self, force_reasoning: bool) -> None:
        super().__init__()
        self._state = "body" if force_reasoning else "outside"
        self._kind = "reasoning" if force_reasoning else "content"

    def _run(self, final: bool) -> None:
        step = {"outside": self._outside, "header": self._header, "body": self._body}
        while step[self._state](final):
            pass

    def _emit_held(self, final: bool, label: Label) -> None:
        """Emit the buffer except a trailing partial marker (kept unless final)."""
        keep = 0 if final else partial_suffix_len(self.tape.text, HARMONY_MARKERS)
        self._emit(len(self.tape.text) - keep, label)

    def _outside(self, final: bool) -> bool:
        i, marker = find_first(self.tape.text, HARMONY_MARKERS)
        if marker is None:
            self._emit_held(final, Label.CONTENT)
            return False
        self._emit(i, Label.CONTENT)
        if marker in _OPENERS:
            self._state = "header"
        else:
            self._consume(len(marker), Label.MARKER)
            if marker == _MESSAGE:  # a body without a header: show it
                self._state, self._kind = "body", "content"
        return True

    def _header(self, final: bool) -> bool:
        i, marker = find_first(self.tape.text, (_MESSAGE, *_CLOSERS))
        if marker is None:
            return False  # an unfinished header has nothing to show
        if marker != _MESSAGE:  # closed before any body: malformed, dropped
            self._consume(i + len(marker), Label.MARKER)
            self._state = "outside"
            return True
        header = self.tape.text[:i]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL_NAME.search(header)
        if recipient and recipient.group(1).startswith("functions."):
            self._kind = "tool"
            self._emit(i + len(_MESSAGE), Label.CONTENT)
        else:
            self._kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"
            self._consume(i + len(_MESSAGE), Label.MARKER)
        self._state = "body"
        return True

    def _body(self, final: bool) -> bool:
        i, marker = find_first(self.tape.text, HARMONY_MARKERS)
        label = Label.REASONING if self._kind == "reasoning" else Label.CONTENT
        if marker is None:
            self._emit_held(final, label)
            return False
        self._emit(i, label)
        tool = self._kind == "tool"
        if marker in _CLOSERS:  # a tool message keeps its closer, for the tool parser
            self._consume(len(marker), Label.CONTENT if tool else Label.MARKER)
            self._state = "outside"
        elif marker in _OPENERS:  # the next message: a tool message cut short is closed
            if tool:
                self._add(_CALL, Label.CONTENT)
            self._state = "outside"
        else:  # a stray <|message|> or <|constrain|> inside a body is dropped
            self._consume(len(marker), Label.MARKER)
        return True


class HarmonyDetector(Detector):
    """``[<|start|>assistant]<|channel|>commentary to=functions.NAME
    [<|constrain|>json]<|message|>{...}<|call|>``.

    The block ends at ``<|call|>``/``<|end|>``/``<|return|>``, or just before the next
    ``<|start|>``/``<|channel|>``. A body that is not a JSON object is passed on as
    the raw arguments string.
    """

    CLOSERS = (_CALL, _END, _RETURN)
    start_markers = _OPENERS
    _RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")

    def scan_call(self, text: str, final: bool) -> CallScan:
        opener = next(m for m in self.start_markers if text.startswith(m))
        m, marker = find_first(text, (_MESSAGE, *self.CLOSERS), len(opener))
        if marker is None and not final:
            return CallScan(PENDING)
        recipient = self._RECIPIENT.search(text, 0, m) if marker == _MESSAGE else None
        if recipient is None:
            return CallScan(TEXT, consumed=len(opener))
        name = recipient.group(1)
        body_start = m + len(_MESSAGE)
        close_at, closer = find_first(text, (*self.CLOSERS, *self.start_markers), body_start)
        close_len = len(closer) if closer in self.CLOSERS else 0
        body_end = close_at if close_at >= 0 else len(text)
        settled = final or close_at >= 0
        p = skip_ws(text, body_start)
        if p < body_end and text[p] != "{":
            if not settled:
                return CallScan(PENDING, name)
            return CallScan(DONE, name, text[p:body_end].strip(), body_end + close_len)
        body = text[:body_end]
        args, obj_end = args_json(body, p, settled) if p < body_end else ("", None)
        markers = (*self.CLOSERS, *self.start_markers)
        end = json_block_end(text, body_end, obj_end, close_at, close_len, markers, final)
        if end is None:
            return CallScan(PENDING, name, args)
        return CallScan(DONE, name, args or ("" if close_at < 0 else "{}"), end)
