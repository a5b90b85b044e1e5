"""Split model output into reasoning and content, streamed or in one piece.

Each family is one incremental state machine. ``parse_non_stream`` feeds the whole
text into a fresh machine and flushes it, so the streamed and one-shot results agree
for any chunking by construction; what keeps that true is that a machine only
decides on text it has seen completely (markers split across chunks are held back
until resolved). See docs/parsers.md for the whitespace rules.
"""

from __future__ import annotations

import re
from typing import Iterable


def partial_suffix_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def find_first(text: str, markers: Iterable[str], start: int = 0) -> tuple[int, str | None]:
    """Earliest occurrence of any marker at or after ``start``: (index, marker), or (-1, None).

    NOTE: with markers of which none is a substring of another, the earliest
    *complete* occurrence in a prefix is also the earliest in any longer text, which
    is what makes deciding on partial input safe.
    """
    best, found = -1, None
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, marker
    return best, found


class _Splitter:
    """Buffered machine: subclasses consume ``_buf`` in ``_run`` and emit via ``_emit``."""

    def __init__(self) -> None:
        self._buf = ""
        self._strip = False  # drop whitespace until the next visible character
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self._buf += text
        self._run(final)
        if final:
            self._buf = ""
        out = "".join(self._reasoning), "".join(self._content)
        self._reasoning.clear()
        self._content.clear()
        return out

    def _run(self, final: bool) -> None:
        raise NotImplementedError

    def _emit(self, to_reasoning: bool, text: str) -> None:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        (self._reasoning if to_reasoning else self._content).append(text)


class ThinkSplitter(_Splitter):
    """``<think>`` ... ``</think>`` (Qwen3).

    - ``<think>`` opens reasoning only as the very first text of the output; later
      it is plain text. With ``force_reasoning`` the template already opened the
      block, and a leading ``<think>`` is dropped.
    - ``</think>`` ends reasoning; ``<tool_call>`` met while reasoning also ends it
      and stays in content for the tool parser.
    - Reasoning is stripped at both ends; content right after ``</think>`` loses its
      leading whitespace. Content is otherwise verbatim and nothing in it is held.
    """

    START, END, TOOL = "<think>", "</think>", "<tool_call>"

    def __init__(self, force_reasoning: bool) -> None:
        super().__init__()
        self._at_head = True
        self._in_reasoning = force_reasoning
        self._strip = force_reasoning

    def _run(self, final: bool) -> None:
        if self._at_head:
            if self._buf.startswith(self.START):
                self._buf = self._buf[len(self.START) :]
                self._in_reasoning = self._strip = True
            elif self.START.startswith(self._buf) and not final:
                return
            self._at_head = False
        if self._in_reasoning:
            self._run_reasoning(final)
        if not self._in_reasoning:
            self._emit(False, self._buf)
            self._buf = ""

    def _run_reasoning(self, final: bool) -> None:
        i, marker = find_first(self._buf, (self.END, self.TOOL))
        if marker is not None:
            self._emit(True, self._buf[:i].rstrip())
            self._in_reasoning = False
            # The tool call itself is content; only </think> is swallowed.
            self._strip = marker == self.END
            self._buf = self._buf[i + len(self.END) :] if marker == self.END else self._buf[i:]
            return
        keep = 0 if final else partial_suffix_len(self._buf, (self.END, self.TOOL))
        # Trailing whitespace waits too: it is dropped if reasoning ends right after it.
        body = self._buf[: len(self._buf) - keep].rstrip()
        self._emit(True, body)
        self._buf = self._buf[len(body) :]


_START, _CHANNEL, _MESSAGE, _CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
_END, _RETURN, _CALL = "<|end|>", "<|return|>", "<|call|>"
_CLOSERS = (_END, _RETURN, _CALL)
_OPENERS = (_START, _CHANNEL)
HARMONY_MARKERS = (*_OPENERS, _MESSAGE, _CONSTRAIN, *_CLOSERS)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")


class HarmonySplitter(_Splitter):
    """OpenAI Harmony (gpt-oss):
    ``[<|start|>ROLE]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY<|end|>``.

    - ``analysis`` bodies are reasoning; ``final``, ``commentary`` without a
      ``to=functions.*`` recipient, unknown channels and text outside any message
      are content. Bodies are verbatim; markers never reach either side.
    - A message addressed ``to=functions.NAME`` is passed to content verbatim, header
      and closer included, for the tool parser. One cut short by the next
      ``<|start|>``/``<|channel|>`` gets a ``<|call|>`` so the parser sees it closed.
    - ``force_reasoning``: the template already opened an analysis message.
    """

    def __init__(self, force_reasoning: bool) -> None:
        super().__init__()
        self._state = "body" if force_reasoning else "outside"
        self._kind = "reasoning" if force_reasoning else "content"

    def _run(self, final: bool) -> None:
        step = {"outside": self._outside, "header": self._header, "body": self._body}
        while step[self._state](final):
            pass

    def _emit_held(self, final: bool, to_reasoning: bool) -> None:
        """Emit the buffer except a trailing partial marker (kept unless final)."""
        keep = 0 if final else partial_suffix_len(self._buf, HARMONY_MARKERS)
        self._emit(to_reasoning, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]

    def _outside(self, final: bool) -> bool:
        i, marker = find_first(self._buf, HARMONY_MARKERS)
        if marker is None:
            self._emit_held(final, to_reasoning=False)
            return False
        self._emit(False, self._buf[:i])
        self._buf = self._buf[i:]
        if marker in _OPENERS:
            self._state = "header"
        else:
            self._buf = self._buf[len(marker) :]
            if marker == _MESSAGE:  # a body without a header: show it
                self._state, self._kind = "body", "content"
        return True

    def _header(self, final: bool) -> bool:
        i, marker = find_first(self._buf, (_MESSAGE, *_CLOSERS))
        if marker is None:
            return False  # an unfinished header has nothing to show
        if marker != _MESSAGE:  # closed before any body: malformed, dropped
            self._buf, self._state = self._buf[i + len(marker) :], "outside"
            return True
        header = self._buf[:i]
        self._buf = self._buf[i + len(_MESSAGE) :]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL_NAME.search(header)
        if recipient and recipient.group(1).startswith("functions."):
            self._kind = "tool"
            self._emit(False, header + _MESSAGE)
        else:
            self._kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"
        self._state = "body"
        return True

    def _body(self, final: bool) -> bool:
        i, marker = find_first(self._buf, HARMONY_MARKERS)
        in_analysis = self._kind == "reasoning"
        if marker is None:
            self._emit_held(final, in_analysis)
            return False
        self._emit(in_analysis, self._buf[:i])
        tool = self._kind == "tool"
        if marker in _CLOSERS:
            self._buf = self._buf[i + len(marker) :]
            if tool:
                self._emit(False, marker)
            self._state = "outside"
        elif marker in _OPENERS:
            self._buf = self._buf[i:]
            if tool:
                self._emit(False, _CALL)
            self._state = "outside"
        else:  # a stray <|message|> or <|constrain|> inside a body is dropped
            self._buf = self._buf[i + len(marker) :]
        return True


SUPPORTED_REASONING_PARSERS: dict[str, type[_Splitter]] = {
    "qwen3": ThinkSplitter,
    "gpt_oss": HarmonySplitter,
}


class ReasoningParser:
    """Separates reasoning from content; one instance per generation."""

    def __init__(self, name: str, force_reasoning: bool = False) -> None:
        if name not in SUPPORTED_REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {name!r}; "
                f"choose one of {sorted(SUPPORTED_REASONING_PARSERS)}"
            )
        self.name = name
        self.force_reasoning = force_reasoning
        self._splitter = SUPPORTED_REASONING_PARSERS[name](force_reasoning)

    def parse_stream_chunk(self, text: str) -> tuple[str, str]:
        """(reasoning_delta, content_delta) for the next piece of output."""
        return self._splitter.feed(text, final=False)

    def flush(self) -> tuple[str, str]:
        """Whatever was held back, at the end of the stream."""
        return self._splitter.feed("", final=True)

    def parse_non_stream(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a complete output; leaves the stream state alone."""
        return SUPPORTED_REASONING_PARSERS[self.name](self.force_reasoning).feed(text, final=True)


def build_reasoning_parser(
    name: str | None, force_reasoning: bool = False
) -> ReasoningParser | None:
    """The parser for a resolved ``--reasoning-parser`` value; None when it is off."""
    if name is None or name == "off":
        return None
    return ReasoningParser(name, force_reasoning)
