"""A `StructuredSpec` as llguidance sees it: its grammar text, the tokenizer it matches against,
and the check that turns a bad schema, regex or grammar into the engine's own message.

llguidance (docs/structured.md says why it, and not xgrammar) compiles lazily: building a
matcher costs little, and the token masks are computed as the output goes.
"""

from __future__ import annotations

import json
import weakref
from functools import lru_cache

import llguidance

from freetoken.core import StructuredSpec

_KINDS = {"json_schema": "json_schema", "regex": "regex", "choice": "choice", "lark": "lark",
          "grammar": "grammar"}  # "grammar": Lark or GBNF text (guided_grammar)
_ANY_OBJECT = json.dumps({"type": "object"})

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ll_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: list[int] | None = None
                 ) -> llguidance.LLTokenizer:
    """llguidance's view of `hf_tokenizer` over the model's `vocab_size` ids (built once per
    tokenizer and size: it walks the whole vocabulary)."""
    per_size = _tokenizers.setdefault(hf_tokenizer, {})
    key = (vocab_size, tuple(eos_token_ids or ()))
    if key not in per_size:
        eos = list(eos_token_ids or []) or None
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.padding is None and backend.truncation is None:
            # llguidance.hf clones the Rust tokenizer to switch these two off before serialising
            # it: 2 s of a 248k vocabulary's first grammar, in each of the two processes.
            per_size[key] = llguidance.LLTokenizer(
                backend.to_str(), n_vocab=vocab_size,
                eos_token=hf_tokenizer.eos_token_id if eos is None else eos)
        else:
            from llguidance.hf import from_tokenizer

            per_size[key] = from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
    return per_size[key]


@lru_cache(maxsize=1024)
def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar of `spec` (cached: one request's n choices, and repeated
    requests, reuse it). Raises ValueError for a kind llguidance does not know."""
    if spec.kind == "json_object":
        return llguidance.grammar_from("json_schema", _ANY_OBJECT)
    if spec.kind not in _KINDS:
        raise ValueError(f"unknown structured output kind {spec.kind!r}")
    return llguidance.grammar_from(_KINDS[spec.kind], spec.value)


def validate(spec: StructuredSpec, tokenizer: llguidance.LLTokenizer) -> str | None:
    """None when `spec` compiles against `tokenizer`, else llguidance's message."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(spec), tokenizer)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return error or None
