"""Byte-level BPE (GPT-2 alphabet) read from the vocabulary alone, never from the server: a
token's raw bytes, one token per byte of a text, and which tokens cover a piece of text."""

from __future__ import annotations


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: vocabulary character -> byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]  # shifted to 256, 257, ...
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


_BYTE_OF = _byte_of_char()
_CHAR_OF = {b: c for c, b in _BYTE_OF.items()}


def token_bytes(tok, token_id: int) -> bytes:
    """A byte-level BPE token's raw bytes, read from the vocabulary (not from the server)."""
    piece = tok.convert_ids_to_tokens(token_id)
    if token_id in tok.added_tokens_decoder:
        return piece.encode()
    return bytes(_BYTE_OF[c] for c in piece)


def byte_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte of `text`, so its characters are split across tokens."""
    return [tok.convert_tokens_to_ids(_CHAR_OF[b]) for b in text.encode()]


def positions(tok, ids: list[int], text: str, start: str = "") -> list[int]:
    """Indices of the tokens of `ids` whose bytes overlap the first `text` after `start`."""
    raw = [token_bytes(tok, i) for i in ids]
    joined = b"".join(raw)
    lo = joined.index(text.encode(), joined.index(start.encode()) + len(start.encode()))
    hi, out, at = lo + len(text.encode()), [], 0
    for j, piece in enumerate(raw):
        if at < hi and at + len(piece) > lo:
            out.append(j)
        at += len(piece)
    return out
