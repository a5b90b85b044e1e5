"""Reasoning and tool-call parsers through `freetoken serve` on scripted models (issue 4).

Servers: `scripted_server` (default script; auto = qwen3 + hermes), `chat_server` (qwen3 +
qwen3_coder), `harmony_server` (a scripted model on the Harmony tokenizer; auto = gpt_oss), and
chat_model_path again with glm45's, mistral's, granite's and phi4_mini_json's parsers
(`parsed_by`).
Every case is asked for once with the openai client and once streamed, and the two messages must
be the same.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.sse import chat_view, merge_chat_stream

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scripted_server(server, scripted_model_path):
    """The default script; auto picks the qwen3 reasoning and hermes tool parsers."""
    return server("--model", str(scripted_model_path))


@pytest.fixture(scope="module")
def chat_server(server, chat_model_path):
    """chat_model_path with qwen3 reasoning (auto) and the qwen3_coder tool parser."""
    return server("--model", str(chat_model_path), "--tool-call-parser", "qwen3_coder")


@pytest.fixture(scope="module")
def harmony_server(server, harmony_scripted_path):
    """The Harmony scripted model; auto picks the gpt_oss reasoning and tool parsers."""
    return server("--model", str(harmony_scripted_path))


@pytest.fixture(scope="module")
def parsed_by(server, chat_model_path):
    """`parsed_by(reasoning, tool)`: chat_model_path served with these parsers."""
    return lambda reasoning, tool: server("--model", str(chat_model_path), "--reasoning-parser",
                                          reasoning, "--tool-call-parser", tool)


def _tool(name: str, **props: str) -> dict:
    schema = {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


WEATHER = _tool("get_weather", city="string", days="integer")
TIME = _tool("get_time", zone="string")


def chat(server, content: str, **kw) -> dict:
    """Ask non-streamed (openai client) and streamed (its SSE chunks), assert they agree, and
    return the message in `chat_view`'s shape plus the raw non-streamed choice."""
    client = server.client()
    messages = [{"role": "user", "content": content}]
    extra = kw.pop("extra_body", None)
    full = client.chat.completions.create(model=None, messages=messages, temperature=0,
                                          extra_body=extra, **kw)
    stream = client.chat.completions.create(model=None, messages=messages, temperature=0,
                                            extra_body=extra, stream=True, **kw)
    chunks = [c.model_dump() for c in stream]
    choice = full.choices[0].model_dump()
    view, streamed = chat_view(choice), merge_chat_stream(chunks)
    assert all(view.pop("call_ids")) and all(streamed.pop("call_ids"))
    assert streamed == view
    return {**view, "choice": choice}


def test_thinking_on_splits_reasoning_from_content(scripted_server):
    out = chat(scripted_server, "hi")
    assert (out["reasoning"], out["content"]) == ("Let me think.", "Use a <b> tag.")
    assert out["calls"] == [] and out["finish_reason"] == "stop"


def test_thinking_off_is_all_content(scripted_server):
    out = chat(scripted_server, "hi", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out["content"] == "Use a <b> tag." and out["choice"]["message"]["reasoning_content"] is None


def test_tool_only_turn(scripted_server):
    out = chat(scripted_server, "What is the weather in Paris?", tools=[WEATHER])
    assert out["reasoning"] == "The user wants the weather."
    assert out["choice"]["message"]["content"] in (None, "") and out["content"] == ""
    assert out["calls"] == [("get_weather", '{"city": "Paris"}')]
    assert out["finish_reason"] == "tool_calls"


def test_tool_choice_none_leaves_the_call_as_text(scripted_server):
    out = chat(scripted_server, "What is the weather in Paris?", tools=[WEATHER], tool_choice="none")
    assert out["calls"] == [] and out["finish_reason"] == "stop"
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert out["content"] == f"<tool_call>\n{call}\n</tool_call>"


def test_length_wins_over_tool_calls(scripted_server):
    # 18 tokens end right after the name: the call is sent, cut short.
    out = chat(scripted_server, "What is the weather in Paris?", tools=[WEATHER], max_tokens=18)
    assert [name for name, _ in out["calls"]] == ["get_weather"]
    assert out["finish_reason"] == "length"


def test_content_then_two_typed_calls_qwen3_coder(chat_server):
    out = chat(chat_server, "[two-calls]", tools=[WEATHER, TIME])
    assert (out["reasoning"], out["content"]) == ("I should look both up.", "One moment.\n")
    assert out["calls"] == [("get_weather", '{"city": "Paris", "days": 3}'),
                            ("get_time", '{"zone": "CET"}')]
    assert out["finish_reason"] == "tool_calls"


def test_bare_function_call_qwen3_coder(chat_server):
    out = chat(chat_server, "[bare-call]", tools=[TIME])
    assert (out["reasoning"], out["content"]) == ("Checking.", "Sure thing\n")
    assert out["calls"] == [("get_time", '{"zone": "CET"}')] and out["finish_reason"] == "tool_calls"


def test_partial_opener_held_to_the_end_is_text(chat_server):
    out = chat(chat_server, "[held]", tools=[TIME])
    assert (out["reasoning"], out["content"]) == ("Checking.", "Call <function")
    assert out["calls"] == [] and out["finish_reason"] == "stop"


def _content_tokens(out: dict) -> str:
    """The text of logprobs.content's entries (their bytes, joined)."""
    return b"".join(bytes(e["bytes"]) for e in out["logprobs"]).decode()


def test_glm45_reasoning_text_and_typed_call(parsed_by):
    out = chat(parsed_by("glm45", "glm45"), "[glm45]", tools=[WEATHER], logprobs=True)
    assert (out["reasoning"], out["content"]) == ("I need the weather.", "One moment.\n")
    assert out["calls"] == [("get_weather", '{"city": "Paris", "days": 3}')]
    assert out["finish_reason"] == "tool_calls"
    assert _content_tokens(out) == "One moment.\n"  # streamed == non-streamed, checked in chat()


def test_mistral_calls_with_nine_character_ids(parsed_by):
    out = chat(parsed_by("off", "mistral"), "[mistral]", tools=[WEATHER, TIME], logprobs=True)
    assert out["content"] == "Checking.\n" and out["reasoning"] == ""
    assert out["calls"] == [("get_weather", '{"city": "Paris", "days": 3}'),
                            ("get_time", '{"zone": "CET"}')]
    assert out["finish_reason"] == "tool_calls" and _content_tokens(out) == "Checking.\n"
    ids = [c["id"] for c in out["choice"]["message"]["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids), ids


def test_granite_call_list(parsed_by):
    out = chat(parsed_by("off", "granite"), "[granite]", tools=[WEATHER, TIME], logprobs=True)
    assert (out["content"], out["reasoning"]) == ("", "")
    assert out["calls"] == [("get_weather", '{"city": "Paris", "days": 3}'),
                            ("get_time", '{"zone": "CET"}')]
    assert out["finish_reason"] == "tool_calls" and out["logprobs"] == []


def test_phi4_mini_functools_list(parsed_by):
    out = chat(parsed_by("off", "phi4_mini_json"), "[phi4_mini]", tools=[TIME], logprobs=True)
    assert (out["content"], out["reasoning"]) == ("Checking.\n", "")
    assert out["calls"] == [("get_time", '{"zone": "CET"}')]
    assert out["finish_reason"] == "tool_calls" and _content_tokens(out) == "Checking.\n"


def test_harmony_analysis_and_final(harmony_server):
    out = chat(harmony_server, "hi")
    assert (out["reasoning"], out["content"]) == ("Let me think.", "Use a <b> tag.")
    assert out["calls"] == [] and out["finish_reason"] == "stop"


def test_harmony_tool_call(harmony_server):
    out = chat(harmony_server, "What is the weather in Paris?", tools=[WEATHER])
    assert out["reasoning"] == "Need the weather." and out["content"] == ""
    assert out["calls"] == [("get_weather", '{"city": "Paris"}')]
    assert out["finish_reason"] == "tool_calls"


BAD_TOOLS = [
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": [TIME, TIME]}, "tools"),
    ({"tools": [_tool("set_tool_choice"), _tool("set_tool_choice")]}, "tools"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice"),
    ({"tools": [TIME], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields,param", BAD_TOOLS)
def test_bad_tools_are_a_400_naming_the_field(scripted_server, fields, param, stream):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream, **fields}
    r = httpx.post(f"{scripted_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "tool" in err["message"]


def test_openai_sdk_tool_loop_sends_the_call_back(scripted_server):
    """call -> tool result -> next turn, as the openai SDK does it: the assistant message goes
    back as the SDK returned it (content null beside tool_calls), then a tool message."""
    client = scripted_server.client()
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=None, messages=messages, tools=[WEATHER],
                                           temperature=0)
    turn = first.choices[0].message
    assert turn.content is None and turn.tool_calls[0].function.name == "get_weather"
    messages += [turn, {"role": "tool", "tool_call_id": turn.tool_calls[0].id,
                        "content": '{"temperature_c": 21}'}]
    # The template renders both the call and its result into the next prompt.
    ids = httpx.post(f"{scripted_server.url}/tokenize", json={"messages": [
        m if isinstance(m, dict) else m.model_dump() for m in messages]}).json()["tokens"]
    prompt = httpx.post(f"{scripted_server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '"name": "get_weather"' in prompt and '{"temperature_c": 21}' in prompt
    second = client.chat.completions.create(model=None, messages=messages, tools=[WEATHER],
                                            temperature=0)
    assert second.choices[0].finish_reason == "tool_calls"  # the script asks again
