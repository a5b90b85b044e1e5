"""The request models (serving/openai/protocol.py): the rules that need nothing but the request refuse
it as it is parsed, the rest as it meets the server's limits in `to_sampling_params`; every
valid value reaches `SamplingParams`, and each refusal is a `RequestError` naming the field (the
HTTP layer renders it as a 400)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from freetoken.serving.errors import RequestError, validation_error
from freetoken.serving.limits import Limits
from freetoken.serving.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest

LIMITS = Limits(vocab_size=1000)
MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="x", **fields)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


def parse_refusal(make, **fields) -> RequestError:
    """The refusal raised as the request is parsed, as errors.py reads it out of pydantic's."""
    with pytest.raises(ValidationError) as exc:
        make(**fields)
    return validation_error(exc.value)


def refusal(make, limits: Limits = LIMITS, **fields) -> RequestError:
    """The refusal of a request, whether it comes as it is parsed or from the limits."""
    try:
        make(**fields).to_sampling_params(limits)
    except ValidationError as exc:
        return validation_error(exc)
    except RequestError as exc:
        return exc
    raise AssertionError(f"accepted: {fields}")


# Refused as the request is parsed: nothing but the request decides.
STATELESS = [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": 2, "temperature": 0}, "n"),
    ({"n": 2, "top_k": 1}, "n"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63 - 1, "n": 2, "temperature": 1}, "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
    ({"stop": [""]}, "stop"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"logprob_token_ids": []}, "logprob_token_ids"),
    ({"logprob_token_ids": [1.5]}, "logprob_token_ids"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": float("-inf")}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": ["\ud800"]}, "bad_words"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"best_of": 2}, "best_of"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"guided_jsonn": {}}, "guided_jsonn"),
]
# Refused against the server's limits (vocabulary, caps, resolved max_tokens).
WITH_LIMITS = [
    ({"logit_bias": {"1000": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"stop_token_ids": [1000]}, "stop_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1000]}, "allowed_token_ids"),
]


@pytest.mark.parametrize("make", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("fields,param", STATELESS)
def test_request_rules_refuse_as_the_request_is_parsed(make, fields, param):
    err = parse_refusal(make, **fields)
    assert err.param == param and err.status == 400, err.message


@pytest.mark.parametrize("make", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("fields,param", WITH_LIMITS)
def test_server_rules_refuse_in_to_sampling_params(make, fields, param):
    req = make(**fields)  # parses
    with pytest.raises(RequestError) as exc:
        req.to_sampling_params(LIMITS)
    assert exc.value.param == param and exc.value.status == 400


def test_messages_match_today():
    assert parse_refusal(completion, temperature=3).message == "temperature must be in [0, 2]"
    assert parse_refusal(chat, n=2, temperature=0).message == \
        "n must be 1 when using greedy sampling, got 2."
    assert parse_refusal(completion, frobnicate=1).message == \
        "Unknown field 'frobnicate': refused rather than ignored"
    assert parse_refusal(completion, best_of=3).message == "best_of is not supported by this server"
    # Over the completions default of 16 max_tokens; chat's default is the rest of the context.
    assert refusal(completion, min_tokens=17).message == \
        "min_tokens must be less than or equal to max_tokens=16, got 17."
    assert chat(min_tokens=17).to_sampling_params(LIMITS).min_tokens == 17
    assert refusal(chat, logit_bias={"1000": 1}).message == \
        "token_id(s) [1000] in logit_bias contain out-of-vocab token ids. Vocabulary size: 1000"
    assert refusal(completion, max_tokens=9, limits=Limits(max_output_tokens=8)).message == \
        "max_tokens must be at most 8 on this server"


def test_max_tokens_zero_is_only_for_echo():
    assert parse_refusal(completion, max_tokens=0).param == "max_tokens"
    req = completion(max_tokens=0, echo=True, logprobs=2)
    assert req.echo_only
    params = req.to_sampling_params(LIMITS)
    assert params.max_tokens == 1 and params.prompt_logprobs == 2


def test_prompt_logprobs_cap_message_matches_vllm():
    assert refusal(completion, prompt_logprobs=21).message == \
        "Requested prompt logprobs of 21, which is greater than max allowed: 20"


def test_fields_reach_sampling_params():
    params = completion(
        presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3,
        logit_bias={"7": -100, "9": 2.5}, min_tokens=3, bad_words=["foo bar"], prompt_logprobs=-1,
        include_stop_str_in_output=True, skip_special_tokens=False,
        spaces_between_special_tokens=False).to_sampling_params(
            Limits(vocab_size=1000, max_logprobs=1000))
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == \
        (0.5, -0.25, 1.3)
    assert params.logit_bias == {7: -100.0, 9: 2.5}
    assert params.min_tokens == 3 and params.bad_words == ["foo bar"]
    assert params.prompt_logprobs == 1000  # -1: the whole vocabulary
    assert params.include_stop_str_in_output and not params.skip_special_tokens
    assert not params.spaces_between_special_tokens


def test_defaults_change_nothing():
    params = completion().to_sampling_params(LIMITS)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == \
        (0, 0, 1)
    assert params.logit_bias is None and params.min_tokens == 0 and params.bad_words == []
    assert params.prompt_logprobs is None and not params.include_stop_str_in_output
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert params.max_tokens == 16 and chat().to_sampling_params(LIMITS).max_tokens is None


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    assert completion(echo=True, logprobs=3).to_sampling_params(LIMITS).prompt_logprobs == 3
    assert completion(echo=True).to_sampling_params(LIMITS).prompt_logprobs is None
    assert completion(logprobs=3).to_sampling_params(LIMITS).prompt_logprobs is None


def test_chat_n_greater_than_one():
    assert chat(n=3, temperature=0.7).to_sampling_params(LIMITS).seed is None
    assert parse_refusal(chat, n=2, temperature=0).param == "n"


@pytest.mark.parametrize("make", [completion, chat], ids=["completions", "chat"])
def test_new_fields_are_off_the_deny_list(make):
    make(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
         logit_bias={"5": 1}, min_tokens=1, bad_words=["x"], prompt_logprobs=1,
         include_stop_str_in_output=True, skip_special_tokens=False,
         spaces_between_special_tokens=False, add_special_tokens=True, user="u",
         request_id="r", best_of=1, suffix="")


CHAT_ONLY = [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    ({"include_reasoning_logprobs": True}, "include_reasoning_logprobs"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
]


@pytest.mark.parametrize("fields,param", CHAT_ONLY)
def test_chat_rules(fields, param):
    fields = {"messages": MESSAGES, **fields}
    err = parse_refusal(ChatCompletionRequest, **fields)
    assert err.param == param and err.status == 400, err.message


def test_chat_logprob_caps_and_message_parts():
    assert refusal(chat, logprobs=True, top_logprobs=21).param == "top_logprobs"
    assert chat(logprobs=True, top_logprobs=3).to_sampling_params(LIMITS).logprobs == 3
    assert chat(top_logprobs=0).to_sampling_params(LIMITS).logprobs is None
    assert parse_refusal(ChatCompletionRequest, messages=[
        {"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text"}]}
    ]).message == "messages[1]: only text content parts are supported"
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert req.messages[0].for_template() == {"role": "user", "content": "ab"}


COMPLETION_PROMPTS = [
    ({"prompt": None}, "prompt must be provided and non-empty"),
    ({"prompt": ""}, "prompt must be provided and non-empty"),
    ({"prompt": []}, "prompt must be provided and non-empty"),
    ({"prompt": [[1, 2], []]}, "prompt must not contain an empty prompt"),
    ({"prompt": ["a", ""]}, "prompt must not contain an empty prompt"),
]


@pytest.mark.parametrize("fields,message", COMPLETION_PROMPTS)
def test_empty_prompts_are_refused_as_parsed(fields, message):
    err = parse_refusal(CompletionRequest, **fields)
    assert (err.param, err.message) == ("prompt", message)


def test_prompts_meet_the_vocabulary_and_the_request_cap():
    assert CompletionRequest(prompt=[1, 2]).prompts(LIMITS) == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2]]).prompts(LIMITS) == [[1], [2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts(LIMITS) == ["a", "b"]
    with pytest.raises(RequestError) as exc:
        CompletionRequest(prompt=[[1, 1000]]).prompts(LIMITS)
    assert (exc.value.param, exc.value.message) == ("prompt", "Token id 1000 is out of vocabulary")
    with pytest.raises(RequestError) as exc:
        CompletionRequest(prompt=["a", "b"], n=3, temperature=1).prompts(
            Limits(max_prompts_per_request=5))
    assert exc.value.param == "prompt"


def test_tokenize_takes_one_of_prompt_or_messages():
    for fields in ({}, {"prompt": "a", "messages": MESSAGES}):
        err = parse_refusal(TokenizeRequest, **fields)
        assert (err.param, err.message) == ("prompt", "give exactly one of prompt or messages")
    assert TokenizeRequest(prompt="a").to_msg().add_special_tokens
    msg = TokenizeRequest(messages=MESSAGES).to_msg()
    assert msg.text == MESSAGES and not msg.add_special_tokens
    assert parse_refusal(TokenizeRequest, messages=[
        {"role": "user", "content": [{"type": "image_url"}]}]).param == "messages"


@pytest.mark.parametrize("effort,ctk,expected", [
    ("high", None, {"reasoning_effort": "high"}),
    ("none", None, {"reasoning_effort": "none", "enable_thinking": False}),
    ("none", {"enable_thinking": True}, {"reasoning_effort": "none", "enable_thinking": True}),
    (None, {"x": 1}, {"x": 1}),
])
def test_reasoning_effort_reaches_the_template_and_none_turns_thinking_off(effort, ctk, expected):
    assert chat(reasoning_effort=effort, chat_template_kwargs=ctk).template_kwargs == expected


def test_an_unknown_reasoning_effort_is_a_400_naming_it():
    with pytest.raises(ValidationError) as exc:
        chat(reasoning_effort="extreme")
    assert validation_error(exc.value).param == "reasoning_effort"


@pytest.mark.parametrize("fields", [{"logprob_token_ids": [1000]}, {"logprob_token_ids": [-1]},
                                    {"logprob_token_ids": list(range(21))}])
@pytest.mark.parametrize("make,on", [(completion, {}), (chat, {"logprobs": True})],
                         ids=["completions", "chat"])
def test_logprob_token_ids_are_checked_against_the_vocabulary_and_the_cap(make, on, fields):
    err = refusal(make, **on, **fields)
    assert err.param == "logprob_token_ids" and err.status == 400, err.message


def test_logprob_token_ids_reach_sampling_params():
    params = completion(logprob_token_ids=[5, 7, 5]).to_sampling_params(LIMITS)
    assert params.logprob_token_ids == [5, 7, 5] and params.logprobs == 0
    params = chat(logprobs=True, logprob_token_ids=[9]).to_sampling_params(LIMITS)
    assert params.logprob_token_ids == [9] and params.logprobs == 0
    assert parse_refusal(chat, logprob_token_ids=[9]).param == "logprob_token_ids"
