"""Prompt rendering and tokenization, run by the frontend off the engine's loop."""

from __future__ import annotations

from functools import cached_property

from freetoken.message import TokenizeMsg


class TokenizeManager:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def render_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                      chat_template_kwargs: dict | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False,
            **(chat_template_kwargs or {}),
        )

    def tokenize(self, msg: TokenizeMsg) -> list[int]:
        """Token ids of a request: id prompts pass through untouched; text gets the tokenizer's
        special tokens (BOS, ...) as `add_special_tokens` says (chat's default is no: the
        template brings its own)."""
        if isinstance(msg.text, list) and (not msg.text or isinstance(msg.text[0], int)):
            return list(msg.text)
        if isinstance(msg.text, list):
            prompt = self.render_prompt(msg.text, msg.tools, msg.chat_template_kwargs)
            return self.tokenizer.encode(prompt, add_special_tokens=msg.add_special_tokens)
        return self.tokenizer.encode(msg.text, add_special_tokens=msg.add_special_tokens)

    def tokenize_texts(self, msgs: list[TokenizeMsg]) -> dict[int, list[int]]:
        """`tokenize` of the text prompts among `msgs`, by uid, in one call of the tokenizer
        for each `add_special_tokens` value: a fast tokenizer encodes a list in one pass of its
        Rust code, with the same ids (64 texts of ~40 tokens: 6-7.5 ms of CPU, against 7.5-11
        a call each). Empty where the tokenizer fails on a list: each prompt then goes alone,
        for its own error."""
        out: dict[int, list[int]] = {}
        for special in (True, False):
            group = [m for m in msgs if isinstance(m.text, str) and m.add_special_tokens == special]
            if not group:
                continue
            try:
                ids = self.tokenizer([m.text for m in group], add_special_tokens=special)["input_ids"]
            except Exception:
                return {}
            out.update(zip((m.uid for m in group), ids))
        return out

    @cached_property
    def max_chars_per_token(self) -> int:
        """The most characters of text one token can stand for: the longest vocabulary entry
        (byte-level pieces spell a byte per character, so text needs at most as many)."""
        return max(map(len, self.tokenizer.get_vocab()), default=1)

    def min_tokens(self, msg: TokenizeMsg) -> int:
        """A lower bound on the request's prompt tokens, known without tokenizing: a prompt of
        c characters needs at least c / max_chars_per_token tokens. Unicode normalisation can
        fold a character pair into one, hence the factor 2."""
        if isinstance(msg.text, list) and (not msg.text or isinstance(msg.text[0], int)):
            return len(msg.text)
        if isinstance(msg.text, str):
            chars = len(msg.text)
        else:
            chars = sum(len(m["content"]) for m in msg.text if isinstance(m.get("content"), str))
        return chars // (2 * self.max_chars_per_token)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences that `SamplingParams.bad_words` ban, by vLLM's
    `SamplingParams.update_from_tokenizer`: each word as spelled at the start of a text, and
    as spelled after a space when that is as many tokens with another first one (the space
    merged into it). A word that tokenizes to nothing bans nothing (vLLM fails on it)."""
    sequences = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences
