"""Incremental detokenization: sampled ids -> exact text deltas, stop strings, per-token text/bytes.

Uses the vLLM/SGLang prefix_offset/read_offset window: each new token decodes only
ids[prefix:], where ids[prefix:read] is the last chunk that produced complete text. Keeping
that chunk in the window preserves context-dependent decoding (sentencepiece strips the
leading space of the first token of a decode), and text ending in U+FFFD (an incomplete
UTF-8 character) is not committed until a later token completes it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence
import weakref

_FFFD = "\ufffd"
_TRIM_AT = 4096  # drop ids before the window once this many pile up (memory only)


@dataclass(slots=True)
class DetokStep:
    text: str  # newly released text
    released: int  # how many fed tokens are newly released (in feed order)
    dropped: int  # how many fed tokens are dropped for good (only when stopped)
    stopped: str | None  # the stop string that matched in this step
    # Per released token, where its share of `text` starts: the text it completed (committed
    # while it was the newest token), cut to what is released. A share runs to the next offset,
    # the last to the end of `text`; text before offsets[0] is the held-back rest of a token
    # released earlier. Chat parsers need these; left out of == as they only split `text`.
    offsets: tuple[int, ...] = field(default=(), compare=False)

    def shares(self) -> list[str]:
        """Each released token's share of `text` (see `offsets`)."""
        o = self.offsets
        return [self.text[a:b] for a, b in zip(o, (*o[1:], len(self.text)))]


def _make_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    # The Rust backend is ~4x faster than the HF wrapper and never applies
    # clean_up_tokenization_spaces, which is not window-stable anyway (off for Qwen).
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Per-request detokenizer. Joined `text` of all steps == decode(all ids), cut at a stop string.

    A token's start offset is the length of the complete text before it; a step releases the
    tokens whose start offset < length of the text released so far (all of them at finish).
    Output controls follow vLLM's v1 detokenizer: the cut falls after the stop string with
    `include_stop_str_in_output`; text completed by the first `min_tokens` tokens ends no stop
    match; with `spaces_between_special_tokens=False` (and specials kept) an added token right
    after another adds its bare content, not what the decoder makes of it.
    """

    def __init__(
        self, tokenizer: Any, stop_strs: Sequence[str] = (), skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False, min_tokens: int = 0,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        self._stops = [s for s in dict.fromkeys(stop_strs) if s]
        self._max_hold = max(map(len, self._stops), default=1) - 1
        self._include_stop = include_stop_str_in_output
        # Released text a match may still start in: none unless nothing is held back.
        self._context = self._max_hold if include_stop_str_in_output else 0
        self._min_tokens = min_tokens
        self._added: dict[int, str] = {}
        if not (skip_special_tokens or spaces_between_special_tokens):
            backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
            self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._after_added = False
        self._ids: list[int] = []
        self._count = 0  # tokens fed
        self._prefix = 0  # window start: first id of the last complete chunk
        self._read = 0  # ids before this have committed their text
        self._prefix_len = 0  # len(decode(ids[prefix:read]))
        self._pend_len = 0  # complete chars decoded past `read` but not committed (before a U+FFFD)
        self._done_len = 0  # chars committed
        # Committed text: `_kept` released chars kept as stop-match context, then the unreleased
        # rest (held back as a possible stop-string start).
        self._buf = ""
        self._kept = 0
        self._shown = 0  # chars released
        # Fed, unreleased tokens: (start offset, chars committed when fed = where its share starts)
        self._fed: deque[tuple[int, int]] = deque()
        self._ended = False

    def step(self, new_ids: Sequence[int], finished: bool) -> DetokStep:
        if self._ended:  # not expected after a stop / finish; nothing more is released
            return DetokStep("", 0, len(new_ids), None)
        for n, tid in enumerate(new_ids, 1):
            self._count += 1
            self._fed.append((self._done_len + self._pend_len, self._done_len))
            self._ids.append(tid)
            delta = self._decode(self._ids[self._prefix :])[self._prefix_len :]
            raw = self._added.get(tid)
            if raw is not None and self._after_added:
                delta = raw  # e.g. WordPiece would put a space before it
            self._after_added = raw is not None
            # Empty growth (skipped special) must not advance: the next token would then
            # decode without context and lose its sentencepiece leading space.
            if delta and not delta.endswith(_FFFD):
                hit = self._commit(delta)
                if hit is not None:
                    return self._stop(*hit, unfed=len(new_ids) - n)
                self._advance()
            else:
                pend = len(delta.rstrip(_FFFD))
                self._pend_len = max(self._pend_len, pend)  # keep starts monotonic
        if finished:
            self._ended = True
            if self._read < len(self._ids):  # flush a dangling partial character as decode() does
                hit = self._commit(self._decode(self._ids[self._prefix :])[self._prefix_len :])
                if hit is not None:
                    return self._stop(*hit, unfed=0)
            text = self._buf[self._kept :]
            self._shown += len(text)
            return DetokStep(text, len(self._fed), 0, None, self._release(text, everything=True))
        keep = len(self._buf) - self._holdback()
        text = self._buf[self._kept : keep]
        self._shown += len(text)
        trim = max(0, keep - self._context)
        self._buf, self._kept = self._buf[trim:], keep - trim
        offsets = self._release(text)
        return DetokStep(text, len(offsets), 0, None, offsets)

    def _advance(self) -> None:
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > _TRIM_AT:
            del self._ids[: self._prefix]
            self._prefix, self._read = 0, self._read - self._prefix
        # Decoded separately: a window's text is not always a slice of a longer decode.
        self._prefix_len = len(self._decode(self._ids[self._prefix : self._read]))
        self._pend_len = 0

    def _commit(self, delta: str) -> tuple[int, str] | None:
        """Append complete text; return (where _buf is cut, stop) for the first-ending match."""
        old = len(self._buf)
        self._buf += delta
        self._done_len += len(delta)
        if self._count <= self._min_tokens:
            return None
        best: tuple[int, int, str] | None = None
        for s in self._stops:
            # _buf[:old] held no match (or was completed within min_tokens), so only matches
            # ending in the new text count; they may start in released context.
            pos = self._buf.find(s, max(0, old - len(s) + 1))
            # Earliest end (then earliest start) wins: independent of how tokens were batched.
            if pos >= 0 and (best is None or (pos + len(s), pos) < best[:2]):
                best = (pos + len(s), pos, s)
        if best is None:
            return None
        return (best[0] if self._include_stop else best[1]), best[2]

    def _stop(self, cut: int, stop: str, unfed: int) -> DetokStep:
        text, self._buf = self._buf[self._kept : cut], ""
        self._shown += len(text)
        offsets = self._release(text)
        dropped = len(self._fed) + unfed  # their text starts at/after the cut
        self._fed.clear()
        self._ended = True
        return DetokStep(text, len(offsets), dropped, stop, offsets)

    def _holdback(self) -> int:
        """Length of the longest suffix of the unreleased text that is a proper prefix of a stop
        string (none when the stop string is released too: the cut then falls after it).

        Else released text never holds a match start: it would have been such a suffix.
        """
        if self._include_stop:
            return 0
        for k in range(min(len(self._buf), self._max_hold), 0, -1):
            tail = self._buf[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self._stops):
                return k
        return 0

    def _release(self, text: str, everything: bool = False) -> tuple[int, ...]:
        """Pop the released tokens (all if `everything`); their offsets in `text`, just released."""
        lo, fed, out = self._shown - len(text), self._fed, []
        while fed and (everything or fed[0][0] < self._shown):
            # A share never starts past `text`'s end (committed <= start < shown, or all shown at
            # finish), but may start before it: that part was shown with an earlier step's tokens.
            out.append(max(fed.popleft()[1] - lo, 0))
        return tuple(out)


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)  # 188 printable bytes map to themselves
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


class TokenTexts:
    """Per-token strings and real UTF-8 bytes for logprob entries; memoised per id."""

    _cache: weakref.WeakKeyDictionary[Any, TokenTexts] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, tokenizer: Any) -> TokenTexts:
        """The shared instance for `tokenizer` (built once)."""
        try:
            inst = cls._cache.get(tokenizer)
            if inst is None:
                inst = cls._cache[tokenizer] = cls(tokenizer)
            return inst
        except TypeError:  # not weak-referenceable (e.g. a bare tokenizers.Tokenizer)
            return cls(tokenizer)

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._byte_level = "ByteLevel" in repr(getattr(self._backend, "decoder", None))
        # Added/special tokens are stored verbatim, not in the byte-level/'▁' encoding.
        self._added = {i: t.content for i, t in self._backend.get_added_tokens_decoder().items()}
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def text(self, token_id: int) -> str:
        """tokenizer.decode([id]) with specials shown literally (vLLM's per-token string)."""
        s = self._texts.get(token_id)
        if s is None:
            s = self._texts[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return s

    def bytes(self, token_id: int) -> bytes:
        """The token's real UTF-8 bytes (a fragment when a character spans tokens)."""
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = self._piece_bytes(token_id)
        return b

    def _piece_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            return bytes(_BYTE_DECODER[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # sentencepiece byte-fallback piece
        return piece.replace("▁", " ").encode()
