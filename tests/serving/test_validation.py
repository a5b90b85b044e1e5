"""`to_sampling_params`: every new client field's valid values reach `SamplingParams`, and each
invalid value is a `RequestError` naming the field (the HTTP layer renders it as a 400)."""

from __future__ import annotations

import pytest

from freetoken.serving.api_models import ChatCompletionRequest, CompletionRequest
from freetoken.serving.errors import RequestError
from freetoken.serving.validation import Limits, echo_only, to_sampling_params, unsupported_reason

LIMITS = Limits(vocab_size=1000)
MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="x", **fields)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


INVALID = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"1000": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": float("-inf")}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": ["\ud800"]}, "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
]


@pytest.mark.parametrize("make", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("fields,param", INVALID)
def test_invalid_values_name_the_field(make, fields, param):
    with pytest.raises(RequestError) as exc:
        to_sampling_params(make(**fields), LIMITS)
    assert exc.value.param == param and exc.value.status == 400


def test_max_tokens_zero_is_only_for_echo():
    with pytest.raises(RequestError) as exc:
        to_sampling_params(completion(max_tokens=0), LIMITS)
    assert exc.value.param == "max_tokens"
    req = completion(max_tokens=0, echo=True, logprobs=2)
    assert echo_only(req)
    params = to_sampling_params(req, LIMITS)
    assert params.max_tokens == 1 and params.prompt_logprobs == 2


def test_prompt_logprobs_cap_message_matches_vllm():
    with pytest.raises(RequestError) as exc:
        to_sampling_params(completion(prompt_logprobs=21), LIMITS)
    assert exc.value.message == "Requested prompt logprobs of 21, which is greater than max allowed: 20"


def test_fields_reach_sampling_params():
    params = to_sampling_params(completion(
        presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3,
        logit_bias={"7": -100, "9": 2.5}, min_tokens=3, bad_words=["foo bar"], prompt_logprobs=-1,
        include_stop_str_in_output=True, skip_special_tokens=False,
        spaces_between_special_tokens=False), Limits(vocab_size=1000, max_logprobs=1000))
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == \
        (0.5, -0.25, 1.3)
    assert params.logit_bias == {7: -100.0, 9: 2.5}
    assert params.min_tokens == 3 and params.bad_words == ["foo bar"]
    assert params.prompt_logprobs == 1000  # -1: the whole vocabulary
    assert params.include_stop_str_in_output and not params.skip_special_tokens
    assert not params.spaces_between_special_tokens


def test_defaults_change_nothing():
    params = to_sampling_params(completion(), LIMITS)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0, 0, 1)
    assert params.logit_bias is None and params.min_tokens == 0 and params.bad_words == []
    assert params.prompt_logprobs is None and not params.include_stop_str_in_output
    assert params.skip_special_tokens and params.spaces_between_special_tokens


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    assert to_sampling_params(completion(echo=True, logprobs=3), LIMITS).prompt_logprobs == 3
    assert to_sampling_params(completion(echo=True), LIMITS).prompt_logprobs is None
    assert to_sampling_params(completion(logprobs=3), LIMITS).prompt_logprobs is None


def test_chat_n_greater_than_one():
    assert to_sampling_params(chat(n=3, temperature=0.7), LIMITS).seed is None
    with pytest.raises(RequestError) as exc:
        to_sampling_params(chat(n=2, temperature=0), LIMITS)
    assert exc.value.param == "n"


@pytest.mark.parametrize("make", [completion, chat], ids=["completions", "chat"])
def test_new_fields_are_off_the_deny_list(make):
    req = make(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
               logit_bias={"5": 1}, min_tokens=1, bad_words=["x"], prompt_logprobs=1,
               include_stop_str_in_output=True, skip_special_tokens=False,
               spaces_between_special_tokens=False, add_special_tokens=True)
    assert unsupported_reason(req) is None
