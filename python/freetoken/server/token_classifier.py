"""Label each sampled token for chat logprobs (issue 7, docs/logprobs.md).

The text parsers decide on decoded text and report no offsets, so ``TokenClassifier``
mirrors them token by token:

- reasoning (``qwen3``, ``gpt_oss``) is read from single-id markers, resolved once; when
  they are not single ids, ``create`` raises ``ClassifierUnavailable`` (the 400's reason);
- tool calls are found by running the tool parser's own detector (``find_start``,
  ``scan_call``) over the tokens' text in ``_CallStream``'s loop, keeping token offsets. This
  covers qwen3_coder's bare ``<function=``, blocks that turn out to be text and truncated
  calls, and needs no signal from the caller.

So a label can wait (a partial opener, a Harmony header, trailing reasoning whitespace):
``feed`` returns the labels decided so far, in token order, and ``ContentLogprobRouter``
pairs them with the caller's entries. Each entry lands in one list, in order, whatever the
engine steps, so streaming and non-streaming agree by construction.

A token whose text is partly visible and partly stripped or markup (``" Hello"`` right
after ``</think>``, ``".<"`` before a bare call) is CONTENT; its bytes then carry the
dropped characters. Not seen as the text parsers see them: markers spelled as several
tokens, a whitespace character split across tokens, Harmony's synthetic ``<|call|>``.
The text parsers are assumed to see every token's text except special ids (Qwen: special
added tokens are skipped), and, for gpt_oss, the Harmony markers.
"""

from __future__ import annotations

import enum
import weakref
from collections import deque
from typing import Any, Callable

from freetoken.server.function_call_parser import DONE, PENDING, SUPPORTED_TOOL_CALL_PARSERS
from freetoken.server.reasoning_parser import _CHANNEL_NAME, _RECIPIENT, HARMONY_MARKERS
from freetoken.server.reasoning_parser import partial_suffix_len
from freetoken.tokenizer.detokenize import TokenTexts


class Label(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"  # the only label with a logprobs.content entry
    TOOL = "tool"
    MARKER = "marker"
    SPECIAL = "special"
    HIDDEN = "hidden"  # whitespace the text parsers strip


class ClassifierUnavailable(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_NEEDED = {"qwen3": ("<think>", "</think>", "<tool_call>"), "gpt_oss": HARMONY_MARKERS}
_OPENERS, _MESSAGE, _CLOSERS = HARMONY_MARKERS[:2], HARMONY_MARKERS[2], HARMONY_MARKERS[4:]
_IDS: weakref.WeakKeyDictionary[Any, dict[str, int | None]] = weakref.WeakKeyDictionary()


def _single_id(tokenizer: Any, marker: str) -> int | None:
    """The marker's id if it encodes to exactly one id that decodes back to it (cached)."""
    cache = _IDS.setdefault(tokenizer, {})
    if marker not in cache:
        ids = list(tokenizer.encode(marker, add_special_tokens=False))
        ok = len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == marker
        cache[marker] = ids[0] if ok else None
    return cache[marker]


def _listing(items: list[str]) -> str:
    q = [f"`{m}`" for m in items]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " and " + q[-1]


class _CallScan:
    """``_CallStream.feed`` over token pieces: each token becomes normal text (CONTENT, as
    soon as one of its characters is shown), stripped whitespace (HIDDEN) or call text (TOOL)."""

    def __init__(self, tool_parser: str, put: Callable[[int, Label], None]) -> None:
        self.det, self.put = SUPPORTED_TOOL_CALL_PARSERS[tool_parser](None), put
        self.buf, self.base = "", 0  # unconsumed text; offset of buf[0] in all text fed
        self.toks: deque[list[Any]] = deque()  # [slot, start, end, in a call, labelled]
        self.in_call, self.strip = False, True

    def feed(self, slot: int | None, text: str, final: bool = False) -> None:
        end = self.base + len(self.buf) + len(text)
        if slot is not None:  # None: text without a token (Harmony's synthetic <|call|>)
            self.toks.append([slot, end - len(text), end, False, False])
        self.buf += text
        while True:
            if not self.in_call:
                start = self.det.find_start(self.buf)
                if start < 0:
                    keep = 0 if final else partial_suffix_len(self.buf, self.det.start_markers)
                    return self._consume(len(self.buf) - keep, call=False)
                self._consume(start, call=False)
                self.in_call = True
            scan = self.det.scan_call(self.buf, final)
            if scan.status == PENDING:  # detectors settle when final; if not, the text is lost
                return self._consume(len(self.buf), call=True) if final else None
            self._consume(scan.consumed, call=scan.status == DONE)
            self.in_call = False
            self.strip = self.strip or scan.status == DONE  # whitespace after a call is dropped

    def _consume(self, n: int, call: bool) -> None:
        text, self.buf = self.buf[:n], self.buf[n:]
        lo, self.base = self.base, self.base + n
        if not call and self.strip:  # as _CallStream._text: lstrip until something shows
            lo += len(text) - len(text.lstrip())
            self.strip = not text.strip()
        for tok in self.toks:
            if tok[1] >= self.base or lo >= self.base:
                break
            if tok[2] > lo and not tok[4]:
                tok[3] = tok[3] or call
                if not call:  # shown: final at once, so it goes with the next delta
                    tok[4] = True
                    self.put(tok[0], Label.CONTENT)
        while self.toks and self.toks[0][2] <= self.base:
            slot, _, _, in_call, labelled = self.toks.popleft()
            if not labelled:
                self.put(slot, Label.TOOL if in_call else Label.HIDDEN)


class TokenClassifier:
    """Per request: ``feed(id)`` -> the labels decided now, in order; ``finish()`` -> the rest."""

    def __init__(self, tokenizer: Any, reasoning: str | None, tool: str | None,
                 force_reasoning: bool, ids: dict[str, int]) -> None:  # fmt: skip
        self._texts = TokenTexts.of(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        self._special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._special |= {*(getattr(tokenizer, "all_special_ids", None) or ())}
        self._special |= {eos} if isinstance(eos, int) else set(eos or ())
        self._think = ids if reasoning == "qwen3" else {}
        self._harmony = {i: m for m, i in ids.items()} if reasoning == "gpt_oss" else {}
        self._scan = _CallScan(tool, self._put) if tool else None
        self._labels: deque[Label | None] = deque()
        self._first = 0  # slot of _labels[0]
        # qwen3, as ThinkSplitter
        self._reasoning = reasoning == "qwen3" and force_reasoning
        self._at_head = True
        self._r_strip = True  # reasoning's leading whitespace is dropped
        self._r_ws: list[int] = []  # trailing whitespace: shown only if reasoning text follows
        self._c_strip = False  # content right after </think> loses its leading whitespace
        # gpt_oss, as HarmonySplitter
        self._h_state = "body" if force_reasoning else "outside"
        self._h_kind = "reasoning" if force_reasoning else "content"
        self._header: list[tuple[int, int]] = []

    @classmethod
    def create(cls, tokenizer: Any, reasoning_parser: str | None, tool_parser: str | None,
               force_reasoning: bool) -> TokenClassifier:  # fmt: skip
        reasoning = None if reasoning_parser in (None, "off") else reasoning_parser
        tool = None if tool_parser in (None, "off") else tool_parser
        if reasoning is not None and reasoning not in _NEEDED:
            raise ClassifierUnavailable(f"logprobs do not support --reasoning-parser {reasoning}")
        if tool is not None and tool not in SUPPORTED_TOOL_CALL_PARSERS:
            raise ClassifierUnavailable(f"logprobs do not support --tool-call-parser {tool}")
        if tool == "gpt_oss" and reasoning != "gpt_oss":  # its markers would be special ids
            raise ClassifierUnavailable(
                "logprobs with --tool-call-parser gpt_oss need --reasoning-parser gpt_oss"
            )
        needed = list(_NEEDED.get(reasoning or "", ()))
        ids = {m: _single_id(tokenizer, m) for m in needed}
        missing = [m for m in needed if ids[m] is None]
        if missing:
            if missing == needed:
                are = "they are"
            else:
                are = _listing(missing) + (" is" if len(missing) == 1 else " are")
            raise ClassifierUnavailable(
                f"logprobs with --reasoning-parser {reasoning} need {_listing(needed)} to be "
                f"single tokens in this model's vocabulary; {are} not"
            )
        return cls(tokenizer, reasoning, tool, force_reasoning, ids)  # type: ignore[arg-type]

    def feed(self, token_id: int) -> list[Label]:
        slot = self._first + len(self._labels)
        self._labels.append(None)
        if self._harmony:
            self._harmony_step(slot, token_id, self._harmony.get(token_id))
        elif token_id in self._special and token_id not in self._think.values():
            self._put(slot, Label.SPECIAL)  # no text for the parsers, no state change
        else:
            self._think_step(slot, token_id)
        return self._release()

    def finish(self) -> list[Label]:
        """End of output, as the parsers' flush() / finish_stream()."""
        for slot in self._r_ws:  # reasoning is stripped at the end too
            self._put(slot, Label.HIDDEN)
        for slot, _ in self._header:  # an unfinished header is never shown
            self._put(slot, Label.MARKER)
        self._r_ws, self._header = [], []
        if self._scan is not None:
            self._scan.feed(None, "", final=True)
        return self._release()

    def _put(self, slot: int, label: Label) -> None:
        self._labels[slot - self._first] = label

    def _release(self) -> list[Label]:
        out: list[Label] = []
        while self._labels and self._labels[0] is not None:
            out.append(self._labels.popleft())  # type: ignore[arg-type]
            self._first += 1
        return out

    def _piece(self, token_id: int) -> str:
        # The real bytes, not decode([id]): sentencepiece pieces keep their leading space.
        return self._texts.bytes(token_id).decode("utf-8", "replace")

    def _content(self, slot: int, token_id: int) -> None:
        """A token whose text the reasoning parser passes on as content."""
        piece = self._piece(token_id)
        if self._c_strip:
            if not piece.strip():
                return self._put(slot, Label.HIDDEN)
            self._c_strip = False
        if self._scan is None:
            self._put(slot, Label.CONTENT)
        else:
            self._scan.feed(slot, piece)

    def _think_step(self, slot: int, token_id: int) -> None:
        ids, head = self._think, self._at_head
        self._at_head = False
        if ids and head and token_id == ids["<think>"]:  # opens reasoning only as the first text
            self._reasoning = True
            return self._put(slot, Label.MARKER)
        if not self._reasoning:  # in content no marker is tracked
            return self._content(slot, token_id)
        if token_id in (ids["</think>"], ids["<tool_call>"]):
            for ws in self._r_ws:  # reasoning is stripped before its end
                self._put(ws, Label.HIDDEN)
            self._r_ws, self._reasoning = [], False
            if token_id == ids["<tool_call>"]:  # ends reasoning and is content, for the tool parser
                return self._content(slot, token_id)
            self._c_strip = True
            return self._put(slot, Label.MARKER)
        if self._piece(token_id).strip():
            for s in (*self._r_ws, slot):
                self._put(s, Label.REASONING)
            self._r_ws, self._r_strip = [], False
        elif self._r_strip:
            self._put(slot, Label.HIDDEN)
        else:
            self._r_ws.append(slot)

    def _harmony_step(self, slot: int, token_id: int, marker: str | None) -> None:
        if marker is None and token_id in self._special:
            return self._put(slot, Label.SPECIAL)
        if self._h_state == "header":
            if marker == _MESSAGE:
                return self._end_header(slot, token_id)
            if marker not in _CLOSERS:
                return self._header.append((slot, token_id))
            for s, _ in [*self._header, (slot, token_id)]:  # closed before any body: dropped
                self._put(s, Label.MARKER)
            self._header, self._h_state = [], "outside"
            return None
        if self._h_state == "body":
            tool = self._h_kind == "tool"
            if marker is None:
                if self._h_kind == "reasoning":
                    return self._put(slot, Label.REASONING)
                return self._content(slot, token_id)
            if marker not in (*_CLOSERS, *_OPENERS):  # a stray <|message|>/<|constrain|>
                return self._put(slot, Label.MARKER)
            self._h_state = "outside"
            if marker in _CLOSERS:  # a tool message keeps its closer, for the tool parser
                return self._content(slot, token_id) if tool else self._put(slot, Label.MARKER)
            if tool and self._scan is not None:  # cut short by the next message
                self._scan.feed(None, "<|call|>")
        if marker is None:  # text outside any message is content
            self._content(slot, token_id)
        elif marker in _OPENERS:
            self._header, self._h_state = [(slot, token_id)], "header"
        else:
            if marker == _MESSAGE:  # a body without a header is shown
                self._h_state, self._h_kind = "body", "content"
            self._put(slot, Label.MARKER)

    def _end_header(self, slot: int, token_id: int) -> None:
        tokens = [*self._header, (slot, token_id)]
        text = b"".join(self._texts.bytes(t) for _, t in self._header).decode("utf-8", "replace")
        recipient, channel = _RECIPIENT.search(text), _CHANNEL_NAME.search(text)
        self._header, self._h_state = [], "body"
        if recipient and recipient.group(1).startswith("functions."):
            self._h_kind = "tool"  # the whole message is content verbatim, for the tool parser
            for s, t in tokens:
                self._content(s, t)
            return
        self._h_kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"
        for s, _ in tokens:
            self._put(s, Label.MARKER)


class ContentLogprobRouter:
    """Per request: holds each released token's logprob entry until its delta is emitted.

    ``add`` every released sampled token, in order; ``take_for_delta`` when a non-empty
    content delta is emitted (the CONTENT entries labelled so far); ``take_rest`` at the
    finish, for the finish_reason chunk. The reasoning pair does the same for
    ``include_reasoning_logprobs``. Without a classifier every entry is CONTENT.
    """

    def __init__(self, classifier: TokenClassifier | None = None) -> None:
        self.classifier = classifier
        self.labels: list[Label] = []  # decided labels, in token order
        self._waiting: deque[Any] = deque()
        self._held: dict[Label, list[Any]] = {Label.CONTENT: [], Label.REASONING: []}
        self._finished = False

    def add(self, token_id: int, entry: Any) -> None:
        self._waiting.append(entry)
        self._route(self.classifier.feed(token_id) if self.classifier else [Label.CONTENT])

    def take_for_delta(self) -> list[Any]:
        return self._take(Label.CONTENT)

    def take_reasoning_for_delta(self) -> list[Any]:
        return self._take(Label.REASONING)

    def take_rest(self) -> list[Any]:
        self._finish()
        return self._take(Label.CONTENT)

    def take_reasoning_rest(self) -> list[Any]:
        self._finish()
        return self._take(Label.REASONING)

    def _take(self, label: Label) -> list[Any]:
        out, self._held[label] = self._held[label], []
        return out

    def _finish(self) -> None:
        if not self._finished and self.classifier is not None:
            self._route(self.classifier.finish())
        self._finished = True

    def _route(self, labels: list[Label]) -> None:
        for label in labels:
            entry = self._waiting.popleft()
            self.labels.append(label)
            if label in self._held:
                self._held[label].append(entry)
