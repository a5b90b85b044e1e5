"""Prompt rendering and tokenization, run by the frontend off the engine's loop."""

from __future__ import annotations

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
        """Token ids of a request: id prompts pass through untouched; a rendered chat prompt
        already carries its special tokens, a raw completion prompt gets the tokenizer's."""
        if isinstance(msg.text, list) and (not msg.text or isinstance(msg.text[0], int)):
            return list(msg.text)
        if isinstance(msg.text, list):
            prompt = self.render_prompt(msg.text, msg.tools, msg.chat_template_kwargs)
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.tokenizer.encode(msg.text)
