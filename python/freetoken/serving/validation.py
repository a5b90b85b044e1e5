"""Request validation and the one pure function that turns a request into `SamplingParams`.

Every refusal leaves as a `RequestError` naming the field, which `errors.py` renders as an
OpenAI-shaped 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from freetoken.core import SAMPLING_EPS, SamplingParams
from freetoken.serving import structured
from freetoken.serving.api_models import ChatCompletionRequest, CompletionRequest
from freetoken.serving.errors import RequestError

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy default, as vLLM
MAX_N = 16
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    """What the server knows that the request must fit: vocabulary, caps, defaults."""

    vocab_size: int | None = None
    max_logprobs: int = 20
    max_output_tokens: int | None = None
    return_tokens_as_token_ids: bool = False
    max_prompts_per_request: int = 1024
    max_running_requests: int = 64  # also how many prompts of one request run at once


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
    "logprob_token_ids": _neutral(None),
    "function_call": _neutral(None),
    "functions": _neutral(None),
    "reasoning_effort": _neutral(None),
}

# Accepted because they cannot change the generated result.
HARMLESS_FIELDS = {"user", "request_id", "priority", "cache_salt", "metadata", "store",
                   "service_tier", "parallel_tool_calls", "documents", "return_token_ids"}
# Read by structured.requested (structured outputs), not ignored.
STRUCTURED_FIELDS = {*structured.SPEC_FIELDS, "guided_decoding_backend", "guided_whitespace_pattern"}


def unsupported_reason(req: CompletionRequest | ChatCompletionRequest) -> RequestError | None:
    fields = {name: getattr(req, name) for name in type(req).model_fields}
    fields.update(req.model_extra or {})
    for name, value in fields.items():
        check = UNSUPPORTED_FIELDS.get(name)
        if check is not None and not check(value):
            return RequestError(f"{name} is not supported by this server", param=name)
    for name in req.model_extra or {}:
        if name not in UNSUPPORTED_FIELDS and name not in HARMLESS_FIELDS | STRUCTURED_FIELDS:
            return RequestError(f"Unknown field {name!r}: refused rather than ignored", param=name)
    return None


def _check_ids(ids: list[int], vocab_size: int | None, param: str, what: str) -> None:
    for token in ids:
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise RequestError(f"Token id {token} is out of vocabulary" if what == "prompt"
                               else f"{param} contains out-of-vocab token id {token}", param=param)


def prompt_list(req: CompletionRequest, limits: Limits) -> list[str | list[int]]:
    """The request's prompts as strings or id lists (a flat id list is one prompt)."""
    prompt = req.prompt
    if prompt is None or prompt == "" or prompt == []:
        raise RequestError("prompt must be provided and non-empty", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        prompts: list = [list(prompt)]
    else:
        prompts = list(prompt)
    if len(prompts) * req.n > limits.max_prompts_per_request:
        raise RequestError(f"A request may carry at most {limits.max_prompts_per_request} prompts "
                           f"x n; this one has {len(prompts)} x {req.n}.", param="prompt")
    for p in prompts:
        if len(p) == 0:
            raise RequestError("prompt must not contain an empty prompt", param="prompt")
        if isinstance(p, list):
            _check_ids(p, limits.vocab_size, "prompt", "prompt")
    return prompts


def _check_logprobs(k: int, limits: Limits, param: str, kind: str = "sample") -> int:
    """`k` checked against the cap, with -1 (the whole vocabulary) resolved."""
    if k == -1:
        k = limits.vocab_size or 1 << 30
    if k < 0:
        raise RequestError(f"`{param}` must be a positive value or -1.", param=param)
    if k > limits.max_logprobs:
        raise RequestError(f"Requested {kind} logprobs of {k}, which is greater than max "
                           f"allowed: {limits.max_logprobs}", param=param)
    return k


def echo_only(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """`echo` with `max_tokens: 0`: the prompt (and its logprobs) alone. As vLLM, one token is
    generated and dropped, and counted in `usage`."""
    return (isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0
            and req.max_completion_tokens is None)


def _penalties(req: CompletionRequest | ChatCompletionRequest, limits: Limits,
               max_tokens: int | None) -> dict[str, Any]:
    """The logit-processing fields of `SamplingParams`, checked (vLLM's bounds)."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            if not -2.0 <= value <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {value}.", param=name)
            out[name] = value
    if req.repetition_penalty is not None:
        if not (0.0 < req.repetition_penalty and math.isfinite(req.repetition_penalty)):
            raise RequestError("repetition_penalty must be a finite number greater than zero, "
                               f"got {req.repetition_penalty}.", param="repetition_penalty")
        out["repetition_penalty"] = req.repetition_penalty
    if req.logit_bias:
        out["logit_bias"] = _logit_bias(req.logit_bias, limits.vocab_size)
    min_tokens = req.min_tokens or 0
    if min_tokens < 0:
        raise RequestError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
                           param="min_tokens")
    if max_tokens is not None and min_tokens > max_tokens:
        raise RequestError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                           f"got {min_tokens}.", param="min_tokens")
    out["min_tokens"] = min_tokens
    for word in req.bad_words or []:
        if not word.strip():
            raise RequestError("bad_words must not contain empty or blank words", param="bad_words")
        if not _is_utf8(word):
            raise RequestError("bad_words must be valid UTF-8 text (a lone surrogate is not)",
                               param="bad_words")
    out["bad_words"] = list(req.bad_words or [])
    return out


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _logit_bias(bias: dict[str, float], vocab_size: int | None) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}.",
                               param="logit_bias") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise RequestError(f"token_id(s) [{token}] in logit_bias contain out-of-vocab token "
                               f"ids. Vocabulary size: {vocab_size}", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise RequestError(f"logit_bias values must be in [-100, 100], got {value} for token "
                               f"{token}.", param="logit_bias")
        out[token] = value
    return out


def to_sampling_params(req: CompletionRequest | ChatCompletionRequest, limits: Limits) -> SamplingParams:
    """Validate the sampling fields and build the engine's `SamplingParams` (pure)."""
    chat = isinstance(req, ChatCompletionRequest)
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise RequestError("temperature must be in [0, 2]", param="temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise RequestError("top_p must be in (0, 1]", param="top_p")
    top_k = -1 if req.top_k is None else req.top_k
    if top_k < -1:
        raise RequestError("top_k must be -1 (disabled) or at least 0", param="top_k")
    min_p = 0.0 if req.min_p is None else req.min_p
    if not 0.0 <= min_p <= 1.0:
        raise RequestError("min_p must be in [0, 1]", param="min_p")
    if not 1 <= req.n <= MAX_N:
        raise RequestError(f"n must be between 1 and {MAX_N}", param="n")
    if req.n > 1 and (temperature < SAMPLING_EPS or top_k == 1):
        raise RequestError(f"n must be 1 when using greedy sampling, got {req.n}.", param="n")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED - (req.n - 1):
        # Choice j of n draws with seed + j; torch seeds are 64-bit.
        raise RequestError(f"seed must be in [0, {MAX_SEED - (req.n - 1)}]", param="seed")
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only allowed with stream=true", param="stream_options")

    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        # Chat: None, the rest of the context (resolved by the engine); completions: the legacy 16.
        max_tokens = limits.max_output_tokens or (None if chat else DEFAULT_COMPLETION_MAX_TOKENS)
    elif echo_only(req):
        max_tokens = 1
    elif max_tokens < 1:
        raise RequestError(f"{field} must be at least 1, got {max_tokens}.", param=field)
    elif limits.max_output_tokens is not None and max_tokens > limits.max_output_tokens:
        raise RequestError(f"{field} must be at most {limits.max_output_tokens} on this server",
                           param=field)

    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stops):
        raise RequestError("stop strings must not be empty", param="stop")
    _check_ids(req.stop_token_ids or [], limits.vocab_size, "stop_token_ids", "ids")

    allowed = req.allowed_token_ids
    if allowed is not None:
        if not allowed:
            raise RequestError("allowed_token_ids must not be empty", param="allowed_token_ids")
        _check_ids(allowed, limits.vocab_size, "allowed_token_ids", "ids")

    if chat:
        if req.top_logprobs is not None and (req.top_logprobs > 0 or req.top_logprobs == -1) \
                and not req.logprobs:
            raise RequestError("when using `top_logprobs`, `logprobs` must be set to true.",
                               param="top_logprobs")
        if req.top_logprobs is not None:
            _check_logprobs(req.top_logprobs, limits, "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        if req.logprobs is not None:
            _check_logprobs(req.logprobs, limits, "logprobs")
        logprobs = req.logprobs
    if logprobs == -1:
        logprobs = limits.vocab_size
    prompt_logprobs = None
    if req.prompt_logprobs is not None:
        if req.stream:
            raise RequestError("`prompt_logprobs` are not available when `stream=True`.",
                               param="prompt_logprobs")
        prompt_logprobs = _check_logprobs(req.prompt_logprobs, limits, "prompt_logprobs", "prompt")
    elif not chat and req.echo and logprobs is not None:
        prompt_logprobs = logprobs  # echoed prompt tokens come with their logprobs, as vLLM

    as_ids = req.return_tokens_as_token_ids
    found = structured.requested(req)
    return SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=req.seed,
        max_tokens=max_tokens,
        stop_strs=stops,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        allowed_token_ids=list(allowed) if allowed is not None else None,
        return_tokens_as_token_ids=limits.return_tokens_as_token_ids if as_ids is None else as_ids,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        structured=found.spec if found is not None else None,  # chat adds where it starts
        **_penalties(req, limits, None if max_tokens is None else max_tokens),
    )
