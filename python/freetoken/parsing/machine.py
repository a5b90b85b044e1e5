"""The driver: one per request, fed the released tokens with their text.

The text goes through the request's stages (a reasoning splitter, then the tool-call stream
over what it passes on as content). Every character is labelled by the stage that finally
consumes it, and every token by its characters: CONTENT as soon as one of them is shown as
content (its entry then goes with that very delta), otherwise, once all of them are
consumed, REASONING, TOOL, MARKER or HIDDEN, the first that applies. So the text deltas and
the logprob labels are one reading of the output, not two machines kept in step by tests.

A token with no text of its own is SPECIAL when its id is special (a skipped special token);
otherwise it is part of a character completed by a later token (a UTF-8 character split
across byte tokens is released with the token that completes it) and takes that token's label.
Labels are released in token order, so ``LogprobRouter`` can pair them with the entries.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from freetoken.parsing.calls import ToolCallItem
from freetoken.parsing.stage import Label, Span, Stage

_RANK = (Label.REASONING, Label.TOOL, Label.MARKER, Label.HIDDEN)  # none of it is content


@dataclass
class Step:
    """What one feed decided: each side's text, tool-call items (name first, then argument
    fragments), and the labels of the tokens decided now, in token order."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallItem] = field(default_factory=list)
    labels: list[Label] = field(default_factory=list)


@dataclass(eq=False)
class _Token:
    left: int  # characters not labelled yet
    seen: set[Label] = field(default_factory=set)
    label: Label | None = None
    # Earlier tokens with no text of their own: part of a character this one completes.
    adopted: list[_Token] = field(default_factory=list)


class OutputParser:
    """``feed`` each reply's released tokens, ``finish`` at the end of the output.

    Without stages every token is CONTENT (SPECIAL if its id is in ``special_ids``) and the
    text passes through as it is.
    """

    def __init__(self, stages: Sequence[Stage] = (), special_ids: frozenset[int] = frozenset()):
        self._stages = list(stages)
        self._special = special_ids
        self._tokens: dict[int, _Token] = {}  # by slot, until released
        self._order: deque[int] = deque()  # slots not released yet
        self._orphans: list[_Token] = []  # tokens with no text, waiting for one that has
        self._next = 0  # the next token's slot
        self._last: int | None = None  # the last token fed: owner of a held-back rest
        self._finished = False

    def feed(self, token_ids: Sequence[int], text: str,
             pieces: Sequence[str] | None = None) -> Step:
        """``text``: what the reply released; ``pieces``: each token's part of it. The text
        ends with the pieces; what comes before them is the rest of earlier tokens' text that
        was held back (a possible stop string)."""
        step = Step()
        if not self._stages:
            step.content = text
            special, content = Label.SPECIAL, Label.CONTENT
            step.labels = [special if t in self._special else content for t in token_ids]
            return step
        if pieces is None:
            raise ValueError("parsing the output needs each token's text (UserReply.token_texts)")
        lead = text[: len(text) - sum(map(len, pieces))]
        owned: list[tuple[int | None, str]] = []
        if lead:
            owned.append((self._last, lead))
            tok = self._tokens.get(self._last)  # type: ignore[arg-type]
            if tok is not None and tok.label is None:
                tok.left += len(lead)
                self._adopt(tok)
        for token_id, piece in zip(token_ids, pieces, strict=True):
            slot, self._next = self._next, self._next + 1
            tok = self._tokens[slot] = _Token(len(piece))
            self._order.append(slot)
            if not piece and token_id in self._special:
                tok.label = Label.SPECIAL
            elif not piece:
                self._orphans.append(tok)
            else:
                self._adopt(tok)
            owned.append((slot, piece))
            self._last = slot
        self._run(owned, False, step)
        return step

    def feed_text(self, text: str) -> Step:
        """Text that no token is known for (labels nothing)."""
        return self.feed((), text, ())

    def finish(self) -> Step:
        """End of output: held text comes out, a call cut short is closed (or, if its name
        never arrived, given back as text), and every token left gets its label."""
        step = Step()
        if self._stages and not self._finished:
            self._run([], True, step)
        self._finished = True
        return step

    def _run(self, pieces: list[tuple[int | None, str]], final: bool, step: Step) -> None:
        for k, stage in enumerate(self._stages):
            spans, calls = stage.feed(pieces, final)
            step.calls += calls
            passed_on = k + 1 < len(self._stages)
            pieces = []
            for span in spans:
                if span.label is Label.CONTENT and passed_on:  # for the next stage to read
                    pieces.append((span.owner, span.text))
                    continue
                if span.label is Label.REASONING:
                    step.reasoning += span.text
                elif span.label is Label.CONTENT:
                    step.content += span.text
                self._mark(span)
        step.labels = self._release(final)

    def _mark(self, span: Span) -> None:
        tok = self._tokens.get(span.owner) if span.owner is not None else None
        if tok is None or tok.label is not None:
            return
        tok.seen.add(span.label)
        tok.left -= len(span.text)
        if span.label is Label.CONTENT:
            self._decide(tok, Label.CONTENT)
        elif tok.left <= 0:
            self._decide(tok, next(x for x in _RANK if x in tok.seen))

    def _adopt(self, tok: _Token) -> None:
        if tok in self._orphans:  # text arrived for it later (a held-back rest)
            self._orphans.remove(tok)
        tok.adopted, self._orphans = tok.adopted + self._orphans, []

    @staticmethod
    def _decide(tok: _Token, label: Label) -> None:
        for t in (tok, *tok.adopted):
            t.label = label

    def _release(self, final: bool) -> list[Label]:
        if final:
            for tok in self._orphans:  # no token completed their character
                tok.label = Label.HIDDEN
            self._orphans = []
            for slot in reversed(self._order):  # a token before the ones it adopted
                tok = self._tokens[slot]
                if tok.label is None:
                    label = next((x for x in _RANK if x in tok.seen), Label.HIDDEN)
                    for t in (tok, *tok.adopted):
                        t.label = label
        out: list[Label] = []
        while self._order and self._tokens[self._order[0]].label is not None:
            out.append(self._tokens.pop(self._order.popleft()).label)  # type: ignore[arg-type]
        return out


def join_steps(steps: Iterable[Step]) -> Step:
    """The steps of one output as one step; tool-call items merged into one per call."""
    out = Step()
    calls: dict[int, ToolCallItem] = {}
    for step in steps:
        out.reasoning += step.reasoning
        out.content += step.content
        out.labels += step.labels
        for item in step.calls:
            call = calls.setdefault(item.tool_index, ToolCallItem(item.tool_index))
            call.name = item.name if item.name is not None else call.name
            call.parameters += item.parameters
    out.calls = list(calls.values())
    return out


class LogprobRouter:
    """Pairs each released token's logprob entry with its label (both come in token order).

    ``add`` the entries of the released tokens, ``route`` the labels the parser decided;
    CONTENT and REASONING entries are then held until ``take`` hands them to a delta of their
    side, or to the finish chunk.
    """

    def __init__(self) -> None:
        self.labels: list[Label] = []  # decided labels, in token order
        self._waiting: deque[Any] = deque()
        self._held: dict[Label, list[Any]] = {Label.CONTENT: [], Label.REASONING: []}

    def add(self, entries: Iterable[Any]) -> None:
        self._waiting.extend(entries)

    def route(self, labels: Iterable[Label]) -> None:
        for label in labels:
            entry = self._waiting.popleft()
            self.labels.append(label)
            if label in self._held:
                self._held[label].append(entry)

    def take(self, label: Label) -> list[Any]:
        out, self._held[label] = self._held[label], []
        return out
