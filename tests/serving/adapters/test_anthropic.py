"""Anthropic requests as the chat requests of the same conversation, and their refusals."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from freetoken.serving.adapters.anthropic import MessagesRequest
from freetoken.serving.errors import RequestError, anthropic_body, validation_error


def body(**fields) -> dict:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 9, **fields}).chat_body()


def test_a_tool_round_trip_becomes_chat_messages():
    chat = body(system=[{"type": "text", "text": "Be brief."}], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Ask the tool.", "signature": "s"},
            {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "5 C"}]},
                                     {"type": "text", "text": "And now?"}]}],
        stop_sequences=["X"], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        tools=[{"name": "w", "input_schema": {"type": "object"}}], thinking={"type": "disabled"})
    assert chat == {
        "model": "m", "max_tokens": 9, "stop": ["X"],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.",
             "tool_calls": [{"id": "t1", "type": "function",
                             "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "5 C"},
            {"role": "user", "content": "And now?"}],
        "tools": [{"type": "function", "function": {"name": "w",
                                                    "parameters": {"type": "object"}}}],
        "tool_choice": "required", "parallel_tool_calls": False,
        "chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}}),
])
def test_tool_choices(choice, expected):
    tools = [{"name": "w", "input_schema": {"type": "object"}}]
    assert body(messages=[{"role": "user", "content": "x"}], tools=tools,
                tool_choice=choice)["tool_choice"] == expected


@pytest.mark.parametrize("fields,words", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
])
def test_refusals_name_what_is_refused(fields, words):
    with pytest.raises((ValidationError, RequestError)) as exc:
        body(**{"messages": [{"role": "user", "content": "x"}], **fields})
    err = exc.value if isinstance(exc.value, RequestError) else validation_error(exc.value)
    assert words in err.message


def test_the_error_shape_is_anthropics():
    assert anthropic_body(RequestError("no", status=404)) == {
        "type": "error", "error": {"type": "not_found_error", "message": "no"}}
