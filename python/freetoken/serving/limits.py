"""What the server knows that a request must fit (vocabulary, caps, defaults), and the checks
against it. The app builds one `Limits` from its `FrontendConfig`; the requests' rules that need
nothing but the request are their own (protocol.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from freetoken.serving.errors import RequestError


@dataclass(frozen=True)
class Limits:
    vocab_size: int | None = None
    max_logprobs: int = 20
    max_output_tokens: int | None = None
    return_tokens_as_token_ids: bool = False
    max_prompts_per_request: int = 1024
    max_labels: int = 64
    max_running_requests: int = 64  # also how many prompts of one request run at once

    @classmethod
    def of(cls, config: Any) -> Limits:
        """The limits a `FrontendConfig` sets; a field the config lacks keeps its default."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)
                      if hasattr(config, f.name)})

    def check_ids(self, ids: list[int], param: str) -> None:
        for token in ids:
            if token < 0 or (self.vocab_size is not None and token >= self.vocab_size):
                raise RequestError(f"Token id {token} is out of vocabulary" if param == "prompt"
                                   else f"{param} contains out-of-vocab token id {token}",
                                   param=param)

    def check_logit_bias(self, tokens: list[int]) -> None:
        for token in tokens:
            if token < 0 or (self.vocab_size is not None and token >= self.vocab_size):
                raise RequestError(f"token_id(s) [{token}] in logit_bias contain out-of-vocab "
                                   f"token ids. Vocabulary size: {self.vocab_size}",
                                   param="logit_bias")

    def logprobs(self, k: int, param: str, kind: str = "sample") -> int:
        """`k` logprobs checked against the cap, with -1 (the whole vocabulary) resolved."""
        k = (self.vocab_size or 1 << 30) if k == -1 else k
        if k > self.max_logprobs:
            raise RequestError(f"Requested {kind} logprobs of {k}, which is greater than max "
                               f"allowed: {self.max_logprobs}", param=param)
        return k

    def max_tokens(self, field: str, requested: int | None, default: int | None) -> int | None:
        """`requested` checked against the server's cap; unset, the cap or else `default`."""
        if requested is None:
            return self.max_output_tokens or default
        if self.max_output_tokens is not None and requested > self.max_output_tokens:
            raise RequestError(f"{field} must be at most {self.max_output_tokens} on this server",
                               param=field)
        return requested

    def check_prompt_count(self, prompts: int, n: int) -> None:
        if prompts * n > self.max_prompts_per_request:
            raise RequestError(f"A request may carry at most {self.max_prompts_per_request} "
                               f"prompts x n; this one has {prompts} x {n}.", param="prompt")
