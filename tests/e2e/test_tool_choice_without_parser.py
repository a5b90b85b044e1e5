"""What the openai SDK and LangChain ask of a server without a tool parser: `models.retrieve`,
`tool_choice` "required" or a named function (forced with the grammar engine and returned as
tool calls), and `reasoning_effort` (into the chat template, as the template reads it)."""

from __future__ import annotations

import json
from typing import Literal

import langchain_openai
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

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


def test_models_retrieve_finds_the_served_model_and_404s_another(no_tool_parser):
    client = no_tool_parser.client()
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_forced_and_returned_as_its_call(no_tool_parser, stream):
    client = no_tool_parser.client()
    choice = {"type": "function", "function": {"name": "plan_trip"}}
    kw = dict(model=None, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
              max_tokens=80, reasoning_effort="none")
    if not stream:
        out = client.chat.completions.create(**kw).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content is None
        [call] = out.message.tool_calls
        assert call.function.name == "plan_trip" and call.id
        _valid_trip(call.function.arguments)
        return
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"name": part.function.name, "arguments": ""})
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [c["name"] for c in calls.values()] == ["plan_trip"]
    _valid_trip(calls[0]["arguments"])


def test_required_gives_one_call_or_more_of_the_tools(no_tool_parser):
    out = no_tool_parser.client().chat.completions.create(
        model=None, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=120, reasoning_effort="none", parallel_tool_calls=False).choices[0]
    assert out.finish_reason == "tool_calls"
    [call] = out.message.tool_calls
    assert call.function.name in ("plan_trip", "get_time")
    json.loads(call.function.arguments)


class Trip(BaseModel):
    """A trip to plan."""

    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)


def test_langchain_function_calling_without_a_tool_parser(no_tool_parser):
    llm = langchain_openai.ChatOpenAI(base_url=f"{no_tool_parser.url}/v1", api_key="x",
                                      model=no_tool_parser.client().models.list().data[0].id,
                                      max_tokens=60, temperature=0, max_retries=0, timeout=600,
                                      reasoning_effort="none")
    out = llm.with_structured_output(Trip, method="function_calling").invoke("Plan a trip.")
    assert isinstance(out, Trip)


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
