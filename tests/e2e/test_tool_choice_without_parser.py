"""What the openai SDK and LangChain ask of a server without a tool parser: `models.retrieve`,
`tool_choice` "required" or a named function (forced with the grammar engine and returned as
tool calls, cut short by `max_tokens` as far as they were generated), and `reasoning_effort`
(into the chat template, as the template reads it)."""

from __future__ import annotations

import json
from typing import Literal

import langchain_openai
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from freetoken.parsing.tool_grammar import hermes, token_literal

pytestmark = pytest.mark.slow

TRIP = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "plan_trip", "parameters": TRIP}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
             "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "Plan a trip to Oslo."}]


@pytest.fixture(scope="module")
def no_tool_parser(server, tiny_qwen3_path):
    """The tiny random Qwen3 with its real template, qwen3 reasoning and no tool parser."""
    return server("--model", str(tiny_qwen3_path), "--tool-call-parser", "off",
                  "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def harmony(server, harmony_scripted_path):
    return server("--model", str(harmony_scripted_path))


def _valid_trip(arguments: str) -> dict:
    args = json.loads(arguments)
    assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7 and set(args) <= set(TRIP[
        "properties"])
    return args


NAMED = {"type": "function", "function": {"name": "plan_trip"}}
FORCED = dict(model=None, messages=ASK, tools=TOOLS[:1], tool_choice=NAMED, temperature=0,
              reasoning_effort="none")
ARGS_AT = '"arguments": '


def chat_prompt_ids(client, tokenizer, **kw) -> list[int]:
    """The prompt ids chat runs for `kw`, read from its prompt logprobs (whose first position
    is None: that is the template's opening token)."""
    out = client.chat.completions.create(**kw, max_tokens=1, extra_body={"prompt_logprobs": 0})
    rest = [int(next(iter(p))) for p in out.model_extra["prompt_logprobs"][1:]]
    return [tokenizer.convert_tokens_to_ids("<|im_start|>"), *rest]


def streamed(client, **kw) -> tuple[str, dict[int, dict], str]:
    """(content, calls by index, finish_reason) joined from a chat stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"name": part.function.name, "arguments": ""})
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_models_retrieve_finds_the_served_model_and_404s_another(no_tool_parser):
    client = no_tool_parser.client()
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_forced_and_returned_as_its_call(no_tool_parser, stream):
    client = no_tool_parser.client()
    kw = dict(FORCED, tools=TOOLS, max_tokens=80)
    if not stream:
        out = client.chat.completions.create(**kw).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content is None
        [call] = out.message.tool_calls
        assert call.function.name == "plan_trip" and call.id
        _valid_trip(call.function.arguments)
        return
    content, calls, finish = streamed(client, **kw)
    assert (content, finish) == ("", "tool_calls")
    assert [c["name"] for c in calls.values()] == ["plan_trip"]
    _valid_trip(calls[0]["arguments"])


def test_required_gives_one_call_or_more_of_the_tools(no_tool_parser):
    out = no_tool_parser.client().chat.completions.create(
        model=None, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=120, reasoning_effort="none", parallel_tool_calls=False).choices[0]
    assert out.finish_reason == "tool_calls"
    [call] = out.message.tool_calls
    assert call.function.name in ("plan_trip", "get_time")
    json.loads(call.function.arguments)


def test_a_forced_call_cut_by_max_tokens_keeps_its_arguments_as_generated(no_tool_parser,
                                                                           qwen35_tokenizer):
    """The reference is the raw output of a completion of the same prompt ids under the same
    grammar, its token ids decoded by the tokenizer up to each cut: whatever follows
    '"arguments": ' there, at cuts that fall inside the arguments."""
    client, tok = no_tool_parser.client(), qwen35_tokenizer
    ids = chat_prompt_ids(client, tok, **FORCED)
    grammar = hermes(TOOLS[:1], "plan_trip", False, token_literal(tok))
    raw = client.completions.create(model=None, prompt=ids, max_tokens=80, temperature=0,
                                    logprobs=0, extra_body={"structured_outputs": {"grammar": grammar},
                                                            "return_tokens_as_token_ids": True})
    out_ids = [int(t.removeprefix("token_id:")) for t in raw.choices[0].logprobs.tokens]
    partial = {}  # cut -> the arguments as generated up to it
    for n in range(1, len(out_ids)):
        _, found, arguments = tok.decode(out_ids[:n]).partition(ARGS_AT)
        if not found:
            continue
        try:
            json.JSONDecoder().raw_decode(arguments)  # past the arguments
        except json.JSONDecodeError:
            partial[n] = arguments
    cuts = sorted(partial)
    assert len(cuts) >= 5
    for n in cuts[:: len(cuts) // 4]:
        out = client.chat.completions.create(**FORCED, max_tokens=n).choices[0]
        assert out.finish_reason == "length"
        assert [(c.function.name, c.function.arguments) for c in out.message.tool_calls] == [
            ("plan_trip", partial[n])]
    for n in (cuts[0], cuts[-1]):
        content, calls, finish = streamed(client, **FORCED, max_tokens=n)
        assert (content, finish) == ("", "length")
        assert calls == {0: {"name": "plan_trip", "arguments": partial[n]}}


def test_a_json_answer_cut_by_max_tokens_is_its_partial_text(no_tool_parser, qwen35_tokenizer):
    client, tok = no_tool_parser.client(), qwen35_tokenizer
    kw = dict(model=None, messages=ASK, temperature=0, reasoning_effort="none",
              response_format={"type": "json_schema",
                               "json_schema": {"name": "trip", "schema": TRIP}})
    ids = chat_prompt_ids(client, tok, **kw)
    for n in (3, 7):
        raw = client.completions.create(model=None, prompt=ids, max_tokens=n, temperature=0,
                                        extra_body={"structured_outputs": {"json": TRIP}})
        partial = raw.choices[0].text
        with pytest.raises(json.JSONDecodeError):
            json.loads(partial)
        out = client.chat.completions.create(**kw, max_tokens=n).choices[0]
        assert (out.message.content, out.finish_reason) == (partial, "length")
        assert streamed(client, **kw, max_tokens=n) == (partial, {}, "length")


class Trip(BaseModel):
    """A trip to plan."""

    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)


def langchain_chat(server, max_tokens: int) -> langchain_openai.ChatOpenAI:
    return langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="x",
                                       model=server.client().models.list().data[0].id,
                                       max_tokens=max_tokens, temperature=0, max_retries=0,
                                       timeout=600, reasoning_effort="none")


def test_langchain_function_calling_without_a_tool_parser(no_tool_parser):
    llm = langchain_chat(no_tool_parser, 60)
    out = llm.with_structured_output(Trip, method="function_calling").invoke("Plan a trip.")
    assert isinstance(out, Trip)


def test_langchain_sees_a_cut_call_as_invalid_rather_than_an_empty_object(no_tool_parser):
    """Cut inside the arguments, the call reaches LangChain as the invalid tool call it is:
    nothing parsed, the partial arguments and the length finish in the raw message (an empty
    object would have failed validation against Trip instead)."""
    llm = langchain_chat(no_tool_parser, 20)
    out = llm.with_structured_output(Trip, method="function_calling", include_raw=True).invoke(
        "Plan a trip.")
    raw = out["raw"]
    assert out["parsed"] is None and raw.tool_calls == []
    assert raw.response_metadata["finish_reason"] == "length"
    [invalid] = raw.invalid_tool_calls
    assert invalid["name"] == "Trip" and invalid["args"].startswith('{"city": ')


@pytest.mark.parametrize("effort", ["low", "high"])
def test_reasoning_effort_is_rendered_into_the_harmony_system_message(harmony,
                                                                      harmony_scripted_path,
                                                                      effort):
    tok = AutoTokenizer.from_pretrained(harmony_scripted_path)
    messages = [{"role": "user", "content": "Say hello."}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                       reasoning_effort=effort)
    assert f"Reasoning: {effort}" in expected
    out = harmony.client().chat.completions.create(model=None, messages=messages,
                                                   reasoning_effort=effort, max_tokens=4,
                                                   temperature=0,
                                                   extra_body={"prompt_logprobs": 0})
    # With no alternatives asked, each position after the first holds its prompt token alone.
    positions = out.model_extra["prompt_logprobs"][1:]
    ids = tok.encode(expected, add_special_tokens=False)
    assert [int(next(iter(p))) for p in positions] == ids[1:]
