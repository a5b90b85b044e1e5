"""The HTTP requests: pydantic models (with messages.py, the only place pydantic is used).

A request checks itself as it is parsed: its validator holds every rule that needs nothing but
the request (ranges, combinations, the fields this server refuses) and parses the
structured-output fields once. `to_sampling_params(limits)` adds the rules that depend on the
server (vocabulary, caps, defaults) and builds the engine's `SamplingParams`. A refusal is a
`RequestError` naming the field; raised in the validator it reaches errors.py inside pydantic's
`ValidationError`, which unwraps it.

Requests keep `extra="allow"`, so an undeclared field is still seen: the validator refuses every
one that could change the result rather than drop it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal

from pydantic import Field, PrivateAttr, StrictBool, StrictInt, StrictStr, model_validator

from freetoken.core import SAMPLING_EPS, SamplingParams
from freetoken.message import TokenizeMsg
from freetoken.parsing import validate_tools
from freetoken.serving.openai import structured
from freetoken.serving.errors import RequestError
from freetoken.serving.limits import Limits
from freetoken.serving.openai.messages import Message, OpenAIBaseModel, Tool
from freetoken.serving.openai.structured import Requested

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy default, as vLLM
MAX_N = 16
MAX_SEED = 2**63 - 1
TokenIds = list[StrictInt]


def _neutral(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


# Fields that would change the result and that we do not implement: refused unless neutral.
# One list for both endpoints; docs/scoring.md mirrors it.
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "best_of": _neutral(None, 1),
    "use_beam_search": _neutral(None, False),
    "length_penalty": _neutral(None, 1, 1.0),
    "logits_processors": _neutral(None, []),
    "suffix": _neutral(None, ""),
    "truncate_prompt_tokens": _neutral(None),
    "prompt_embeds": _neutral(None),
    "vllm_xargs": _neutral(None, {}),
    "function_call": _neutral(None),
    "functions": _neutral(None),
}
# Accepted because they cannot change the generated result.
HARMLESS_FIELDS = {"user", "request_id", "priority", "cache_salt", "metadata", "store",
                   "service_tier", "parallel_tool_calls", "documents", "return_token_ids"}


def _refuse(message: str, param: str) -> RequestError:
    return RequestError(message, param=param)


def _check_logprob_count(k: int, param: str) -> None:
    if k < -1:
        raise _refuse(f"`{param}` must be a positive value or -1.", param)


def _check_text_parts(messages: list[Message]) -> None:
    for i, m in enumerate(messages):
        if isinstance(m.content, list) and any(p.type != "text" or p.text is None
                                               for p in m.content):
            raise _refuse(f"messages[{i}]: only text content parts are supported", "messages")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool = False


class _SamplingRequest(OpenAIBaseModel):
    """The fields both endpoints turn into `SamplingParams`, and their rules."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    seed: StrictInt | None = None
    n: StrictInt = 1
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    allowed_token_ids: TokenIds | None = None
    logprob_token_ids: TokenIds | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: StrictInt | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: StrictInt | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    speculative: StrictBool = True  # ours: False opts out of the server's speculative decoding
    response_format: Any = None  # any shape: structured.py names what is wrong with it
    best_of: StrictInt | None = None  # declared so its neutral values pass (UNSUPPORTED_FIELDS)
    user: str | None = None

    _structured: Requested | None = PrivateAttr(default=None)

    @property
    def structured_output(self) -> Requested | None:
        """The structured output asked for, parsed with the request; None for free output."""
        return self._structured

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @model_validator(mode="after")
    def _check(self) -> _SamplingRequest:
        self._check_fields()
        self._check_sampling()
        self._check_logprobs()
        extra = self.model_extra or {}
        self._structured = structured.requested(
            {name: extra.get(name, getattr(self, name, None)) for name in structured.FIELDS})
        self._check_logit_processing()
        self._check_endpoint()
        return self

    def _check_fields(self) -> None:
        extra = self.model_extra or {}
        for name in [*type(self).model_fields, *extra]:
            check = UNSUPPORTED_FIELDS.get(name)
            if check is not None and not check(getattr(self, name, None)):
                raise _refuse(f"{name} is not supported by this server", name)
        for name in extra:
            if name not in UNSUPPORTED_FIELDS and name not in HARMLESS_FIELDS \
                    and name not in structured.FIELDS:
                raise _refuse(f"Unknown field {name!r}: refused rather than ignored", name)

    def _check_sampling(self) -> None:
        temperature = 1.0 if self.temperature is None else self.temperature
        if not 0.0 <= temperature <= 2.0:
            raise _refuse("temperature must be in [0, 2]", "temperature")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise _refuse("top_p must be in (0, 1]", "top_p")
        if self.top_k is not None and self.top_k < -1:
            raise _refuse("top_k must be -1 (disabled) or at least 0", "top_k")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise _refuse("min_p must be in [0, 1]", "min_p")
        if not 1 <= self.n <= MAX_N:
            raise _refuse(f"n must be between 1 and {MAX_N}", "n")
        if self.n > 1 and (temperature < SAMPLING_EPS or self.top_k == 1):
            raise _refuse(f"n must be 1 when using greedy sampling, got {self.n}.", "n")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED - (self.n - 1):
            # Choice j of n draws with seed + j; torch seeds are 64-bit.
            raise _refuse(f"seed must be in [0, {MAX_SEED - (self.n - 1)}]", "seed")
        if self.stream_options is not None and not self.stream:
            raise _refuse("stream_options is only allowed with stream=true", "stream_options")
        field, max_tokens = self._max_tokens_field()
        if max_tokens is not None and max_tokens < 1 and not self.echo_only:
            raise _refuse(f"{field} must be at least 1, got {max_tokens}.", field)
        if any(s == "" for s in self.stops):
            raise _refuse("stop strings must not be empty", "stop")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise _refuse("allowed_token_ids must not be empty", "allowed_token_ids")

    def _max_tokens_field(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @property
    def echo_only(self) -> bool:
        return False  # completions' echo of the prompt alone (CompletionRequest)

    def _check_logprobs(self) -> None:
        if self.logprob_token_ids is not None and not self.logprob_token_ids:
            raise _refuse("logprob_token_ids must not be empty", "logprob_token_ids")
        if self.prompt_logprobs is not None:
            if self.stream:
                raise _refuse("`prompt_logprobs` are not available when `stream=True`.",
                              "prompt_logprobs")
            _check_logprob_count(self.prompt_logprobs, "prompt_logprobs")

    def _check_logit_processing(self) -> None:
        """vLLM's bounds on the penalties, logit_bias, min_tokens and bad_words."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -2.0 <= value <= 2.0:
                raise _refuse(f"{name} must be in [-2, 2], got {value}.", name)
        value = self.repetition_penalty
        if value is not None and not (0.0 < value and math.isfinite(value)):
            raise _refuse("repetition_penalty must be a finite number greater than zero, "
                          f"got {value}.", "repetition_penalty")
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise _refuse(f"logit_bias keys must be token ids, got {key!r}.",
                              "logit_bias") from None
            if not -100.0 <= value <= 100.0:
                raise _refuse(f"logit_bias values must be in [-100, 100], got {value} for "
                              f"token {token}.", "logit_bias")
        if (self.min_tokens or 0) < 0:
            raise _refuse(f"min_tokens must be greater than or equal to 0, got "
                          f"{self.min_tokens}.", "min_tokens")
        for word in self.bad_words or []:
            if not word.strip():
                raise _refuse("bad_words must not contain empty or blank words", "bad_words")
            if not _is_utf8(word):
                raise _refuse("bad_words must be valid UTF-8 text (a lone surrogate is not)",
                              "bad_words")

    def _check_endpoint(self) -> None:
        """The rules of the endpoint's own fields."""

    def _sampling_params(self, limits: Limits, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None) -> SamplingParams:
        """The endpoint's resolved `max_tokens` and logprobs, with the checks against the
        vocabulary and the caps that both endpoints share."""
        limits.check_ids(self.stop_token_ids or [], "stop_token_ids")
        limits.check_ids(self.allowed_token_ids or [], "allowed_token_ids")
        listed = self.logprob_token_ids
        if listed is not None:
            limits.check_ids(listed, "logprob_token_ids")
            limits.logprobs(len(listed), "logprob_token_ids")
        if self.prompt_logprobs is not None:
            prompt_logprobs = limits.logprobs(self.prompt_logprobs, "prompt_logprobs", "prompt")
        logit_bias = {int(key): value for key, value in (self.logit_bias or {}).items()}
        limits.check_logit_bias(list(logit_bias))
        min_tokens = self.min_tokens or 0
        if max_tokens is not None and min_tokens > max_tokens:
            raise _refuse(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                          f"got {min_tokens}.", "min_tokens")
        as_ids = self.return_tokens_as_token_ids
        found = self._structured
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=-1 if self.top_k is None else self.top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            stop_strs=self.stops,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            allowed_token_ids=None if self.allowed_token_ids is None
            else list(self.allowed_token_ids),
            logprob_token_ids=None if listed is None else list(listed),
            return_tokens_as_token_ids=limits.return_tokens_as_token_ids if as_ids is None
            else as_ids,
            min_tokens=min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=logit_bias or None,
            bad_words=list(self.bad_words or []),
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            speculative=self.speculative,
            structured=found.spec if found is not None else None,  # chat adds where it starts
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds] | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    add_special_tokens: StrictBool = True  # a raw prompt gets the tokenizer's BOS etc.
    labels: list[StrictStr] | list[TokenIds] | None = None  # ours: whole-label scores (labels.py)

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its logprobs) alone. As vLLM, one token
        is generated and dropped, and counted in `usage`."""
        return self.echo and self.max_tokens == 0 and self.max_completion_tokens is None

    def _prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # a flat id list is one prompt
        return list(prompt)

    def _check_logprobs(self) -> None:
        if self.logprobs is not None:
            _check_logprob_count(self.logprobs, "logprobs")
        super()._check_logprobs()

    def _check_endpoint(self) -> None:
        if self.prompt is None or self.prompt == "" or self.prompt == []:
            raise _refuse("prompt must be provided and non-empty", "prompt")
        if any(len(p) == 0 for p in self._prompts()):
            raise _refuse("prompt must not contain an empty prompt", "prompt")
        if self.labels is not None and self.stream:
            raise _refuse("labels are scored for a non-streamed completion only", "labels")

    def prompts(self, limits: Limits) -> list[str | list[int]]:
        """The prompts as strings or id lists, each checked against the vocabulary."""
        prompts = self._prompts()
        limits.check_prompt_count(len(prompts), self.n)
        for p in prompts:
            if isinstance(p, list):
                limits.check_ids(p, "prompt")
        return prompts

    def to_sampling_params(self, limits: Limits) -> SamplingParams:
        max_tokens = 1 if self.echo_only else limits.max_tokens(
            *self._max_tokens_field(), DEFAULT_COMPLETION_MAX_TOKENS)
        logprobs = None if self.logprobs is None else limits.logprobs(self.logprobs, "logprobs")
        if self.logprob_token_ids is not None and logprobs is None:
            logprobs = 0  # the listed ids stand in for the top K (vLLM's num_logprobs)
        # Echoed prompt tokens come with their logprobs, as vLLM.
        echoed = logprobs if self.echo else None
        return self._sampling_params(limits, max_tokens, logprobs, echoed)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    include_reasoning_logprobs: StrictBool = False
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    add_special_tokens: StrictBool = False  # the chat template brings its own

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """`chat_template_kwargs` with `reasoning_effort` in it: a template that reads it
        (gpt-oss's Harmony system message) gets it as it is, and "none" also turns Qwen3's
        thinking off, as vLLM; what `chat_template_kwargs` sets itself wins."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            if self.reasoning_effort == "none":
                kwargs.setdefault("enable_thinking", False)
        return kwargs

    @property
    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def _check_logprobs(self) -> None:
        top = self.top_logprobs
        if top is not None and (top > 0 or top == -1) and not self.logprobs:
            raise _refuse("when using `top_logprobs`, `logprobs` must be set to true.",
                          "top_logprobs")
        if top is not None:
            _check_logprob_count(top, "top_logprobs")
        super()._check_logprobs()

    def _check_endpoint(self) -> None:
        if self.tools is not None or self.tool_choice is not None:
            reason = validate_tools(self.tool_dicts or [], self.tool_choice or "auto")
            if reason is not None:
                raise _refuse(reason, "tool_choice" if reason.startswith("tool_choice")
                              else "tools")
        if self.logprob_token_ids is not None and not self.logprobs:
            raise _refuse("when using `logprob_token_ids`, `logprobs` must be set to true.",
                          "logprob_token_ids")
        if self.include_reasoning_logprobs and not self.logprobs:
            raise _refuse("include_reasoning_logprobs needs logprobs: true",
                          "include_reasoning_logprobs")
        _check_text_parts(self.messages)

    def to_sampling_params(self, limits: Limits) -> SamplingParams:
        """Without the grammar of a forced tool call, which needs the server's parsers
        (chat.py adds it)."""
        # Unset max_tokens: None, the rest of the context (the engine resolves it).
        max_tokens = limits.max_tokens(*self._max_tokens_field(), None)
        top = None if self.top_logprobs is None else limits.logprobs(self.top_logprobs,
                                                                     "top_logprobs")
        return self._sampling_params(limits, max_tokens, (top or 0) if self.logprobs else None,
                                     None)


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: StrictBool | None = None  # prompt: true, messages: false (vLLM's)

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _refuse("give exactly one of prompt or messages", "prompt")
        _check_text_parts(self.messages or [])
        return self

    @property
    def input_field(self) -> str:
        return "prompt" if self.prompt is not None else "messages"

    def to_msg(self) -> TokenizeMsg:
        # vLLM's defaults: a prompt gets the tokenizer's special tokens, a chat its template's.
        add = self.prompt is not None if self.add_special_tokens is None \
            else self.add_special_tokens
        text = self.prompt if self.prompt is not None \
            else [m.for_template() for m in self.messages]
        return TokenizeMsg(0, text, None, add_special_tokens=add)


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: TokenIds
