"""OpenAI's Responses API (`/v1/responses`, GET and DELETE `/v1/responses/{id}`) as an adapter
over chat: `input` (with `instructions` and a stored `previous_response_id`) becomes chat
messages, the rest a `ChatCompletionRequest`, so the same conversation gives the same prompt and
answer as `/v1/chat/completions`. responses_stream.py turns chat's events into the Responses
events; the non-streamed response is the one the stream completes with.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse
from pydantic import StrictBool, StrictInt, ValidationError, model_validator

from freetoken.serving.openai import chat, generation
from freetoken.serving.errors import RequestError, error_from, validation_error
from freetoken.serving.handling import until_disconnected
from freetoken.serving.limits import Limits
from freetoken.serving.openai.messages import OpenAIBaseModel
from freetoken.serving.openai.protocol import ChatCompletionRequest
from freetoken.serving.adapters.responses_stream import final_response, response_events, sse_events

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient

LOGPROBS = "message.output_text.logprobs"
# Accepted because they cannot change the generated result.
HARMLESS_FIELDS = {"metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier",
                   "stream_options"}
# Refused unless they hold their neutral value.
NEUTRAL = {"truncation": (None, "disabled"), "background": (None, False),
           "max_tool_calls": (None,), "conversation": (None,), "prompt": (None,)}


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: StrictInt | None = None
    store: StrictBool = True
    previous_response_id: str | None = None
    stream: StrictBool = False

    @model_validator(mode="after")
    def _known_fields(self) -> ResponsesRequest:
        for name, value in (self.model_extra or {}).items():
            if name in NEUTRAL and value in NEUTRAL[name]:
                continue
            if name not in HARMLESS_FIELDS:
                raise RequestError(f"{name} is not supported by this server", param=name)
        if self.text and (self.text.keys() - {"format", "verbosity"}
                          or self.text.get("verbosity") not in (None, "medium")):
            raise RequestError("text: only format (and verbosity 'medium') is supported",
                               param="text")
        for item in self.include or []:
            if item != LOGPROBS:
                raise RequestError(f"include {item!r} is not supported (only {LOGPROBS!r})",
                                   param="include")
        return self

    @property
    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or [])

    def chat_body(self, history: list[dict]) -> dict[str, Any]:
        """The chat request: `history` (the stored conversation this one continues), then
        `instructions` as the system message, then the input items."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) \
            else self.input
        body: dict[str, Any] = {"model": self.model,
                                "messages": system + history + chat_messages(items)}
        plain = {"max_tokens": self.max_output_tokens, "temperature": self.temperature,
                 "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls}
        body.update({k: v for k, v in plain.items() if v is not None})
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}} \
                if isinstance(choice, dict) and choice.get("type") == "function" else choice
        if self.text and self.text.get("format") is not None:
            body["response_format"] = _response_format(self.text["format"])
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            body["reasoning_effort"] = effort
        if self.logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        elif self.top_logprobs:
            raise RequestError(f"top_logprobs needs include [{LOGPROBS!r}]", param="top_logprobs")
        return body


def _chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise RequestError(f"tools[{i}]: only function tools are supported, not "
                           f"{str(tool.get('type'))[:40]!r}", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k)}
    return {"type": "function", "function": function}


def _response_format(fmt: Any) -> dict:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError("text.format.type must be 'text', 'json_object' or 'json_schema'",
                           param="text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _text_of(content: Any) -> str:
    """A message's text: a string, or its input_text / output_text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or any(
            not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text")
            for p in content):
        raise RequestError("input: only text content parts are supported", param="input")
    return "".join(p.get("text") or "" for p in content)


def chat_messages(items: list[dict]) -> list[dict]:
    """Input items as chat messages. An assistant's run of items (reasoning, its message,
    function calls) is one assistant turn, as chat templates render it."""
    messages: list[dict] = []
    turn: dict | None = None

    def assistant() -> dict:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        return turn

    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            assistant()["content"] += _text_of(item.get("content"))
        elif kind == "message" and item.get("role") in ("user", "system", "developer"):
            turn = None
            messages.append({"role": item["role"], "content": _text_of(item.get("content"))})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = "".join(p.get("text") or "" for p in parts if isinstance(p, dict))
            target = assistant()
            target["reasoning_content"] = target.get("reasoning_content", "") + text
        elif kind == "function_call":
            assistant().setdefault("tool_calls", []).append({
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}})
        elif kind == "function_call_output":
            turn = None
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text_of(output)})
        else:
            raise RequestError(f"input[{i}]: items of type {str(kind)[:40]!r} are not supported",
                               param="input")
    return messages


class ResponseStore:
    """Stored responses for `previous_response_id` and GET/DELETE, in memory: at most
    `capacity`, the least recently used dropped first."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]]:
        if response_id not in self._items:
            raise RequestError(f"Response with id {response_id!r} not found.", param="response_id",
                               status=404)
        self._items.move_to_end(response_id)
        return self._items[response_id]

    def delete(self, response_id: str) -> dict:
        self.get(response_id)
        del self._items[response_id]
        return {"id": response_id, "object": "response", "deleted": True}


def _parse(body: Any, store: ResponseStore) -> tuple[ResponsesRequest, ChatCompletionRequest]:
    try:
        req = ResponsesRequest.model_validate(body)
        history = store.get(req.previous_response_id)[1] if req.previous_response_id else []
        return req, ChatCompletionRequest.model_validate(req.chat_body(history))
    except ValidationError as exc:
        raise validation_error(exc) from None


async def create_response(raw_request, state: EngineClient, limits: Limits,
                          store: ResponseStore):
    try:
        try:
            body = await raw_request.json()
        except ValueError as exc:
            raise RequestError(f"The request body is not valid JSON: {exc}") from None
        req, chat_req = _parse(body, store)
        spec = await chat.prepare(chat_req, state, limits)
        head = {"id": f"resp_{uuid.uuid4().hex}", "object": "response",
                "created_at": int(time.time()),
                "model": req.model or state.config.served_model_name, **_echo(req)}
        events = response_events(await generation.generate_events(state, spec), head, spec,
                                 state, _stored(req, chat_req, store))
        if req.stream:
            return StreamingResponse(sse_events(events), media_type="text/event-stream")
        return await until_disconnected(raw_request, final_response(events))
    except RequestError as exc:
        return error_from(exc)


def _stored(req: ResponsesRequest, chat_req: ChatCompletionRequest, store: ResponseStore):
    """What the finished response calls: keep it (with its conversation) when `store`."""
    # What a response continuing this one starts from: the conversation without this
    # request's instructions (a next request gives its own), then this response's output.
    messages = [m.for_template() for m in chat_req.messages[1 if req.instructions else 0:]]

    def keep(response: dict) -> None:
        if req.store:
            store.put(response, messages + chat_messages(response["output"]))

    return keep


def _echo(req: ResponsesRequest) -> dict:
    """The request's settings, as a Response repeats them."""
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}},
            "reasoning": req.reasoning, "previous_response_id": req.previous_response_id,
            "store": req.store, "top_logprobs": req.top_logprobs, "metadata": {},
            "error": None}
