"""OpenAI's Responses API through the real `openai` SDK: plain and streamed (the stream's final
response equals the non-streamed one), reasoning items, a tool round trip, json_schema,
logprobs, previous_response_id with GET/DELETE, a cut response, refusals; the same prompt and
answer as /v1/chat/completions."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
NO_THINKING = {"effort": "none"}


@pytest.fixture(scope="module")
def scripted(server, scripted_model_path):
    """The default script; auto picks the qwen3 reasoning and hermes tool parsers."""
    return server("--model", str(scripted_model_path))


@pytest.fixture(scope="module")
def tiny(server, tiny_qwen3_path):
    """The tiny random Qwen3, its real template, qwen3 reasoning, hermes tool calls."""
    return server("--model", str(tiny_qwen3_path), "--tool-call-parser", "hermes")


def model(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def _without_ids(response: dict) -> dict:
    out = {k: v for k, v in response.items() if k not in ("id", "created_at")}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")}
                     for item in response["output"]]
    out["usage"] = {**out["usage"], "input_tokens_details": None}  # the prefix cache warms up
    return out


def both(server, **kw) -> Response:
    """The response created greedily, checked against the one its stream completes with, and
    against the SDK's Response type as raw JSON."""
    kw = {"model": model(server), "temperature": 0, **kw}
    client = server.client()
    full = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert _without_ids(events[-1].response.model_dump()) == _without_ids(full.model_dump())
    raw = httpx.post(f"{server.url}/v1/responses", json=kw, timeout=300).json()
    Response.model_validate(raw)
    return full


def test_reasoning_and_message_items(scripted):
    r = both(scripted, input="Hello", max_output_tokens=40)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me think."
    assert r.output_text == "Use a <b> tag." and r.status == "completed"
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_output_text_logprobs_hold_no_reasoning_token(scripted):
    r = both(scripted, input="Hello", max_output_tokens=40,
             include=["message.output_text.logprobs"], top_logprobs=1)
    [reasoning, message] = r.output
    part = message.content[0]
    assert "".join(e.token for e in part.logprobs) == part.text == "Use a <b> tag."
    assert reasoning.content[0].text == "Let me think."


def test_reasoning_effort_none_turns_thinking_off(scripted):
    r = both(scripted, input="Hello", max_output_tokens=40, reasoning=NO_THINKING)
    assert [i.type for i in r.output] == ["message"] and r.output_text == "Use a <b> tag."


def test_cut_by_max_output_tokens_is_incomplete(scripted):
    r = both(scripted, input="Hello", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_tool_round_trip(scripted):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = both(scripted, input=ask, tools=[WEATHER], max_output_tokens=60)
    call = first.output[-1]
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call", "get_weather", {"city": "Paris"})
    items = [*ask, *[i.model_dump(exclude_none=True) for i in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}]
    second = both(scripted, input=items, tools=[WEATHER], max_output_tokens=60)
    chat = scripted.client().chat.completions.create(
        model=None, max_tokens=60, temperature=0,
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in (
            "name", "description", "parameters")}}],
        messages=[*ask, {"role": "assistant", "content": "",
                         "reasoning_content": first.output[0].content[0].text,
                         "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                             "name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_same_answer_and_logprobs_as_chat(tiny):
    r = both(tiny, instructions="Answer briefly.", input="Name a colour.", max_output_tokens=12,
             reasoning=NO_THINKING, include=["message.output_text.logprobs"], top_logprobs=2)
    chat = tiny.client().chat.completions.create(
        model=None, max_tokens=12, temperature=0, reasoning_effort="none", logprobs=True,
        top_logprobs=2, messages=[{"role": "system", "content": "Answer briefly."},
                                  {"role": "user", "content": "Name a colour."}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    ours = [(e.token, e.logprob, [t.token for t in e.top_logprobs])
            for e in r.output[-1].content[0].logprobs]
    theirs = [(e.token, e.logprob, [t.token for t in e.top_logprobs])
              for e in chat.choices[0].logprobs.content]
    assert ours == theirs and ours


def test_json_schema_format(tiny):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                               "days": {"type": "integer", "minimum": 1,
                                                        "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    r = both(tiny, input="Plan a trip.", max_output_tokens=60, reasoning=NO_THINKING,
             text={"format": {"type": "json_schema", "name": "trip", "schema": schema,
                              "strict": True}})
    trip = json.loads(r.output_text)
    assert trip["city"] in ("Paris", "Oslo") and 1 <= trip["days"] <= 7


def test_previous_response_id_continues_the_stored_conversation(tiny):
    client = tiny.client()
    kw = {"model": model(tiny), "temperature": 0, "max_output_tokens": 8,
          "reasoning": NO_THINKING}
    first = client.responses.create(input="Hi.", **kw)
    second = client.responses.create(input="More.", previous_response_id=first.id, **kw)
    chat = client.chat.completions.create(
        model=None, max_tokens=8, temperature=0, reasoning_effort="none",
        messages=[{"role": "user", "content": "Hi."},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "More."}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


@pytest.mark.parametrize("fields,param", [
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"previous_response_id": "resp_nope"}, "response_id"),
])
def test_refusals_name_the_field(tiny, fields, param):
    r = httpx.post(f"{tiny.url}/v1/responses", json={"input": "x", **fields})
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def harmony(server, harmony_scripted_path):
    """The Harmony scripted model; auto picks the gpt_oss reasoning and tool parsers."""
    return server("--model", str(harmony_scripted_path))


def test_harmony_effort_reasoning_item_and_tool_call(harmony, harmony_scripted_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(harmony_scripted_path)
    r = both(harmony, input="Say hello.", reasoning={"effort": "high"}, max_output_tokens=40)
    assert [(i.type, i.content[0].text) for i in r.output] == [
        ("reasoning", "Let me think."), ("message", "Use a <b> tag.")]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hello."}],
                                     add_generation_prompt=True, tokenize=False,
                                     reasoning_effort="high")
    assert r.usage.input_tokens == len(tok.encode(prompt, add_special_tokens=False))
    call = both(harmony, input="The weather in Paris?", tools=[WEATHER],
                max_output_tokens=60).output[-1]
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call", "get_weather", {"city": "Paris"})


def test_the_stream_names_each_kind_of_delta(scripted):
    events = list(scripted.client().responses.create(
        model=model(scripted), input="What is the weather in Paris?", tools=[WEATHER],
        temperature=0, max_output_tokens=60, stream=True))
    kinds = [e.type for e in events]
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.reasoning_text.delta", "response.reasoning_text.done",
                 "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done",
                 "response.completed"):
        assert kind in kinds, kind
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1]  # the reasoning item, then the call
