"""Responses requests as the chat requests of the same conversation, and the response store."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from freetoken.serving.errors import RequestError, validation_error
from freetoken.serving.adapters.responses import ResponsesRequest, ResponseStore, chat_messages


def test_an_assistants_run_of_items_is_one_turn():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "reasoning", "id": "rs", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Ask."}]},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "5 C"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Cold."}]}]
    assert chat_messages(items) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Ask.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
        {"role": "assistant", "content": "Cold."}]


def test_fields_map_onto_chat():
    req = ResponsesRequest(input="Hi", instructions="Be brief.", max_output_tokens=5,
                           tools=[{"type": "function", "name": "w", "parameters": {}}],
                           tool_choice={"type": "function", "name": "w"},
                           text={"format": {"type": "json_object"}}, reasoning={"effort": "low"},
                           include=["message.output_text.logprobs"], top_logprobs=3)
    assert req.chat_body([{"role": "user", "content": "Before."}]) == {
        "model": None, "max_tokens": 5, "reasoning_effort": "low",
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Before."}, {"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {"name": "w"}}],
        "tool_choice": {"type": "function", "function": {"name": "w"}},
        "response_format": {"type": "json_object"}, "logprobs": True, "top_logprobs": 3}


def test_the_store_drops_the_least_recently_used():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put({"id": name}, [])
    store.get("a")
    store.put({"id": "c"}, [])
    assert store.get("a")[0] == {"id": "a"}
    with pytest.raises(RequestError) as exc:
        store.get("b")
    assert exc.value.status == 404


@pytest.mark.parametrize("fields,param", [
    ({"text": {"verbosity": "low"}}, "text"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"background": True}, "background"),
    ({"frob": 1}, "frob"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
])
def test_what_would_change_the_result_unsupported_is_refused(fields, param):
    with pytest.raises((ValidationError, RequestError)) as exc:
        ResponsesRequest.model_validate({"input": "x", **fields}).chat_body([])
    err = exc.value if isinstance(exc.value, RequestError) else validation_error(exc.value)
    assert err.param == param
