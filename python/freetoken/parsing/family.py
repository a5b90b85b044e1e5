"""What a parser family declares, and the vocabulary facts it is checked against.

A family is its stages (a reasoning splitter, a tool-call detector, or both), the markers that
must be single token ids for chat logprobs, how ``auto`` recognises it, and how its output
starts. Names are given in ``registry``, the one place they live.
"""

from __future__ import annotations

import secrets
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from freetoken.parsing.calls import Detector
from freetoken.parsing.stage import Stage


def openai_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Family:
    name: str
    splitter: Callable[[bool], Stage] | None = None  # reasoning: force_reasoning -> its stage
    detector: Callable[[list[dict] | None], Detector] | None = None  # tool calls: tools -> detector
    markers: tuple[str, ...] = ()  # single ids that chat logprobs need with its reasoning
    detect: tuple[str, ...] = ()  # `auto` picks it when these are single ids...
    template_hint: str | None = None  # ...and the chat template holds this
    thinks_by_default: bool = False  # the template opens reasoning unless enable_thinking: false
    keeps_special_tokens: bool = False  # its markers are special tokens it must see in the text
    calls_need_reasoning: bool = False  # logprobs: its calls are read behind its own reasoning
    call_id: Callable[[], str] = openai_call_id  # a new tool call's id, as its templates take

    def starts_in_reasoning(self, chat_template_kwargs: dict) -> bool:
        """Whether the output starts inside a think block the template opened."""
        thinking = chat_template_kwargs.get("enable_thinking", True) is not False
        return self.thinks_by_default and thinking

    def detected(self, tokenizer: Any, template: str) -> bool:
        if self.template_hint is not None and self.template_hint not in template:
            return False
        return bool(self.detect) and all(single_id(tokenizer, m) is not None for m in self.detect)


class LogprobsUnavailable(Exception):
    """Chat logprobs cannot be labelled with these parsers on this vocabulary (a 400)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check_logprobs(tokenizer: Any, reasoning: Family | None, tool: Family | None) -> None:
    """Raise ``LogprobsUnavailable`` unless the parsers' markers are single ids."""
    if tool is not None and tool.calls_need_reasoning and reasoning is not tool:
        raise LogprobsUnavailable(
            f"logprobs with --tool-call-parser {tool.name} need --reasoning-parser {tool.name}"
        )
    if reasoning is None:
        return
    needed = list(reasoning.markers)
    missing = [m for m in needed if single_id(tokenizer, m) is None]
    if missing:
        are = "they are" if missing == needed else _listing(missing) + (
            " is" if len(missing) == 1 else " are")
        raise LogprobsUnavailable(
            f"logprobs with --reasoning-parser {reasoning.name} need {_listing(needed)} to be "
            f"single tokens in this model's vocabulary; {are} not"
        )


def _listing(items: list[str]) -> str:
    q = [f"`{m}`" for m in items]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " and " + q[-1]


_IDS: weakref.WeakKeyDictionary[Any, dict[str, int | None]] = weakref.WeakKeyDictionary()
_SPECIAL: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _memo(cache: weakref.WeakKeyDictionary, tokenizer: Any, make: Callable[[], Any]) -> Any:
    try:
        if tokenizer not in cache:
            cache[tokenizer] = make()
        return cache[tokenizer]
    except TypeError:  # not weak-referenceable: not cached
        return make()


def single_id(tokenizer: Any, marker: str) -> int | None:
    """The marker's id if it encodes to exactly one id that decodes back to it (cached)."""
    cache = _memo(_IDS, tokenizer, dict)
    if marker not in cache:
        ids = list(tokenizer.encode(marker, add_special_tokens=False))
        ok = len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == marker
        cache[marker] = ids[0] if ok else None
    return cache[marker]


def special_ids(tokenizer: Any) -> frozenset[int]:
    """Special added tokens, the tokenizer's special ids and EOS (cached)."""

    def find() -> frozenset[int]:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        ids |= {*(getattr(tokenizer, "all_special_ids", None) or ())}
        ids |= {eos} if isinstance(eos, int) else set(eos or ())
        return frozenset(ids)

    return _memo(_SPECIAL, tokenizer, find)
