"""uid-keyed messages between the frontend (HTTP, tokenizer, detokenizer) and the engine.

They are plain dataclasses pickled over ZMQ; the engine side speaks token ids only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken.core import SamplingParams, TokenLogprob


@dataclass
class TokenizeMsg:
    """API → frontend tokenizer. `text` is a prompt string, chat messages, or token ids."""

    uid: int
    text: str | list[dict] | list[int]
    sampling_params: SamplingParams
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None
    add_special_tokens: bool = True  # text prompts only; id prompts are taken as they are


@dataclass
class UserMsg:
    """Frontend → engine: a tokenized request."""

    uid: int
    input_ids: list[int]
    sampling_params: SamplingParams


@dataclass
class AbortMsg:
    uid: int


@dataclass
class ExitMsg:
    pass


@dataclass
class DetokenizeMsg:
    """Engine → frontend: what one step produced for one request.

    `matched_stop` is the EOS / stop token id that ended the turn; it is counted as a completion
    token but never shown. `prompt_tokens` is set once, on the request's first message.
    """

    uid: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None
    # With params.prompt_logprobs, on the first message: one entry per prompt token (the first
    # is None: nothing precedes it), each scoring that prompt token given the ones before it.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # with params.pooling, on the first message


@dataclass
class UserReply:
    """Frontend → API handler: released text and the tokens (with logprobs) behind it."""

    uid: int
    incremental_output: str = ""
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens_delta: int = 0
    completion_tokens_delta: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None
    matched_stop: int | str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # The EOS / stop token that ended the turn: completions list it (as vLLM), chat does not.
    stop_logprob: TokenLogprob | None = None
    # When asked for (chat parsers): each released token's part of `incremental_output`, which
    # ends with them; what comes before them is held-back text of earlier tokens.
    token_texts: list[str] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # as DetokenizeMsg's, on the first
    prompt_token_ids: list[int] | None = None  # beside prompt_logprobs
    embedding: list[float] | None = None  # as DetokenizeMsg's
