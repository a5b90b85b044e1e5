"""Anthropic's Messages API through the real `anthropic` SDK: create and stream (joined equal to
the non-streamed message), stop sequences, thinking, a tool round trip, count_tokens, errors in
Anthropic's shape, and the same prompt and answer as /v1/chat/completions."""

from __future__ import annotations

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def scripted(server, scripted_model_path):
    """The default script; auto picks the qwen3 reasoning and hermes tool parsers."""
    return server("--model", str(scripted_model_path))


@pytest.fixture(scope="module")
def tiny(server, tiny_qwen3_path):
    """The tiny random Qwen3, its real template, qwen3 reasoning, hermes tool calls."""
    return server("--model", str(tiny_qwen3_path), "--tool-call-parser", "hermes")


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)


def model(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


# This SDK version has no sampling arguments; the API still takes them.
GREEDY = {"extra_body": {"temperature": 0}}


def both(server, **kw):
    """The message created greedily and the one the stream builds; they must agree (ids
    aside)."""
    kw = {**GREEDY, **kw}
    c = client(server)
    full = c.messages.create(model=model(server), **kw)
    with c.messages.stream(model=model(server), **kw) as stream:
        events = [e.type for e in stream]
        joined = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert _without_ids(joined) == _without_ids(full)
    return full


def _without_ids(message) -> dict:
    dumped = message.model_dump(exclude={"id"})
    for block in dumped["content"]:
        block.pop("id", None)  # tool_use ids are fresh per call
    return dumped


def test_thinking_and_text_blocks(scripted):
    msg = both(scripted, max_tokens=40, thinking={"type": "enabled",
                                                                 "budget_tokens": 1024},
               messages=[{"role": "user", "content": "Hello"}])
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Let me think." and msg.content[0].signature
    assert msg.content[1].text == "Use a <b> tag." and msg.stop_reason == "end_turn"


def test_thinking_disabled_is_text_alone(scripted):
    msg = both(scripted, max_tokens=40, thinking={"type": "disabled"},
               messages=[{"role": "user", "content": "Hello"}])
    assert [(b.type, b.text) for b in msg.content] == [("text", "Use a <b> tag.")]


def test_stop_sequence_is_named(scripted):
    msg = both(scripted, max_tokens=40, stop_sequences=["<b>", "zzz"],
               messages=[{"role": "user", "content": "Hello"}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "<b>"
    assert msg.content[-1].text == "Use a "


def test_max_tokens_cut(scripted):
    msg = both(scripted, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2


def test_tool_round_trip(scripted):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = both(scripted, max_tokens=60, tools=[WEATHER], messages=ask)
    assert msg.stop_reason == "tool_use"
    call = msg.content[-1]
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
    turns = [*ask, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": "21 degrees"}]}]
    c = client(scripted)
    counted = c.messages.count_tokens(model=model(scripted), messages=turns, tools=[WEATHER])
    again = c.messages.create(model=model(scripted), max_tokens=60, tools=[WEATHER],
                              messages=turns, **GREEDY)
    assert again.usage.input_tokens == counted.input_tokens > msg.usage.input_tokens
    # The same conversation in chat's words renders the same prompt.
    chat = scripted.client().chat.completions.create(model=None, max_tokens=60,
        tools=[{"type": "function", "function": {"name": "get_weather",
                                                 "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}],
        messages=[*ask, {"role": "assistant", "content": "",
                         "reasoning_content": msg.content[0].thinking,
                         "tool_calls": [{"id": call.id, "type": "function", "function": {
                             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}])
    assert chat.usage.prompt_tokens == again.usage.input_tokens


def test_forced_tool_choice(tiny):
    # A random model fills a free string until max_tokens: the city is an enum here.
    bounded = {**WEATHER, "input_schema": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}
    msg = both(tiny, max_tokens=60, tools=[bounded], thinking={"type": "disabled"},
               tool_choice={"type": "tool", "name": "get_weather"},
               messages=[{"role": "user", "content": "Weather?"}])
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    assert msg.content[0].input["city"] in ("Paris", "Oslo")


def test_same_answer_as_chat(tiny):
    system, ask = "Answer briefly.", "Name a colour."
    msg = both(tiny, max_tokens=12, system=system,
               messages=[{"role": "user", "content": ask}])
    chat = tiny.client().chat.completions.create(
        model=None, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": ask}])
    text = "".join(b.text for b in msg.content if b.type == "text")
    thinking = "".join(b.thinking for b in msg.content if b.type == "thinking")
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert text == (chat.choices[0].message.content or "")
    assert thinking == (chat.choices[0].message.model_extra.get("reasoning_content") or "")


@pytest.mark.parametrize("body,status,error_type,words", [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
     "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "frob": 1}, 400,
     "invalid_request_error", "frob"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error", "image"),
    ({"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_request_error", "temperature"),
])
def test_errors_in_anthropic_shape(scripted, body, status, error_type, words):
    r = httpx.post(f"{scripted.url}/v1/messages", json={"model": model(scripted), **body})
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == error_type
    assert words in err["error"]["message"]


def test_unknown_model_is_an_sdk_not_found(scripted):
    with pytest.raises(anthropic.NotFoundError):
        client(scripted).messages.create(model="claude-nope", max_tokens=5,
                                         messages=[{"role": "user", "content": "x"}])


@pytest.fixture(scope="module")
def harmony(server, harmony_scripted_path):
    """The Harmony scripted model; auto picks the gpt_oss reasoning and tool parsers."""
    return server("--model", str(harmony_scripted_path))


def test_harmony_thinking_and_tool_use(harmony):
    msg = both(harmony, max_tokens=40, messages=[{"role": "user", "content": "Say hello."}])
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in msg.content] == [("thinking", "Let me think."), ("text", "Use a <b> tag.")]
    msg = both(harmony, max_tokens=60, tools=[WEATHER],
               messages=[{"role": "user", "content": "The weather in Paris?"}])
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[1].input == {"city": "Paris"} and msg.stop_reason == "tool_use"
