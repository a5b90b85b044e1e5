"""What every parser stage shares: the labels, text that remembers its tokens, and the buffered
machine that consumes it front to back.

A stage (a reasoning splitter, the tool-call stream) only ever consumes a prefix of its buffer
and labels what it consumes; text it cannot decide yet (a partial marker, trailing whitespace
that may be stripped) stays in the buffer. Each family's rules are written once, as a stage,
and the labels are read off the same consumption that makes the text deltas.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Any, Iterable, NamedTuple


class Label(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"  # the only label with a logprobs.content entry
    TOOL = "tool"
    MARKER = "marker"
    SPECIAL = "special"
    HIDDEN = "hidden"  # whitespace a parser strips


class Span(NamedTuple):
    """Consumed text of one token (``owner``: its slot; None: text no token wrote)."""

    label: Label
    owner: int | None
    text: str


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


class Tape:
    """Buffered text; each character remembers its owner (the token it came from)."""

    def __init__(self) -> None:
        self.text = ""
        self._runs: deque[list[Any]] = deque()  # [owner, length], in order

    def push(self, owner: int | None, text: str) -> None:
        if not text:
            return
        self.text += text
        if self._runs and self._runs[-1][0] == owner:
            self._runs[-1][1] += len(text)
        else:
            self._runs.append([owner, len(text)])

    def take(self, n: int) -> list[tuple[int | None, str]]:
        """The first ``n`` characters, cut at owner changes."""
        out, taken, self.text = [], self.text[:n], self.text[n:]
        at = 0
        while at < len(taken):
            run = self._runs[0]
            k = min(run[1], len(taken) - at)
            out.append((run[0], taken[at : at + k]))
            at += k
            run[1] -= k
            if run[1] == 0:
                self._runs.popleft()
        return out


class Stage:
    """A buffered machine: ``feed`` appends to the tape and runs ``_run``, which consumes the
    tape front to back with ``_emit`` (text that reaches an output, after the strip rule),
    ``_consume`` (text that does not) and ``_add`` (text that no token wrote). ``leftover``
    labels what is still unconsumed when the output ends."""

    leftover = Label.HIDDEN

    def __init__(self) -> None:
        self.tape = Tape()
        self._strip = False  # drop whitespace until the next visible character
        self._spans: list[Span] = []
        self._calls: list[Any] = []

    def feed(self, pieces: Iterable[tuple[int | None, str]],
             final: bool) -> tuple[list[Span], list[Any]]:
        """(spans consumed, tool-call items) after the pieces; ``final``: no more text comes."""
        for owner, text in pieces:
            self.tape.push(owner, text)
        self._run(final)
        if final and self.tape.text:
            self._consume(len(self.tape.text), self.leftover)
        out = self._spans, self._calls
        self._spans, self._calls = [], []
        return out

    def _run(self, final: bool) -> None:
        raise NotImplementedError

    def _emit(self, n: int, label: Label) -> None:
        if self._strip:
            head = self.tape.text[:n]
            k = len(head) - len(head.lstrip())
            self._consume(k, Label.HIDDEN)
            n -= k
            self._strip = n == 0
        self._consume(n, label)

    def _consume(self, n: int, label: Label) -> None:
        self._spans += [Span(label, owner, text) for owner, text in self.tape.take(n)]

    def _add(self, text: str, label: Label) -> None:
        self._spans.append(Span(label, None, text))
