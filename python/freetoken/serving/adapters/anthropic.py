"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) as an adapter over
chat: the request becomes a `ChatCompletionRequest` (the same conversation, so the same prompt
and the same answer as `/v1/chat/completions`), runs through `chat.prepare` and `generation`,
and its events become Anthropic's content blocks (anthropic_stream.py). Errors take
Anthropic's shape.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from fastapi.responses import StreamingResponse
from pydantic import Field, StrictBool, StrictInt, ValidationError, model_validator

from freetoken.message import TokenizeMsg
from freetoken.serving.openai import chat, generation
from freetoken.serving.adapters.anthropic_stream import folded, message_events, sse_events
from freetoken.serving.errors import RequestError, anthropic_error, validation_error
from freetoken.serving.handling import until_disconnected
from freetoken.serving.limits import Limits
from freetoken.serving.openai.messages import OpenAIBaseModel
from freetoken.serving.openai.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient

# Accepted because they cannot change the generated result.
HARMLESS_FIELDS = {"metadata", "service_tier", "cache_control"}


class Block(OpenAIBaseModel):
    """One content block of any type; `_chat_turns` says which types it reads where."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None  # a tool_result's
    is_error: StrictBool | None = None
    thinking: str | None = None
    signature: str | None = None


class Turn(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(OpenAIBaseModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(OpenAIBaseModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = None  # not enforced: the model thinks within max_tokens


class CountTokensRequest(OpenAIBaseModel):
    model: str
    messages: list[Turn] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="after")
    def _known_fields(self) -> CountTokensRequest:
        for name in self.model_extra or {}:
            if name not in HARMLESS_FIELDS:
                raise RequestError(f"{name} is not supported by this server", param=name)
        return self

    def chat_body(self) -> dict[str, Any]:
        """The chat request of the same conversation, tools and thinking."""
        messages = [{"role": "system", "content": _text(self.system, "system")}] \
            if self.system else []
        for i, turn in enumerate(self.messages):
            messages += _chat_turns(turn, i)
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description else {})}}
                for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool" and not choice.name:
                raise RequestError("tool_choice.name is required with type 'tool'",
                                   param="tool_choice")
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type) or {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if self.thinking is not None and self.thinking.type != "adaptive":  # adaptive: as the
            # template does by default
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type == "enabled"}
        return body


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False

    def chat_body(self) -> dict[str, Any]:
        sampling = {"max_tokens": self.max_tokens, "stop": self.stop_sequences,
                    "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return {**super().chat_body(), **{k: v for k, v in sampling.items() if v is not None}}


def _text(content: str | list[Block] | None, where: str) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    if any(b.type != "text" for b in content):
        raise RequestError(f"{where}: only text blocks are supported here", param="messages")
    return "".join(b.text or "" for b in content)


def _chat_turns(turn: Turn, i: int) -> list[dict]:
    """One Anthropic turn as chat messages: a user turn's tool results become tool messages
    (before its text, as they answer the previous turn), an assistant turn's thinking its
    `reasoning_content` and its tool_use blocks its `tool_calls`."""
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": turn.content}]
    by_type: dict[str, list[Block]] = {}
    for block in turn.content:
        by_type.setdefault(block.type, []).append(block)
    allowed = ("text", "tool_result") if turn.role == "user" else ("text", "tool_use", "thinking")
    refused = sorted(set(by_type) - set(allowed))
    if refused:
        raise RequestError(f"messages[{i}]: {refused[0]} content blocks are not supported in "
                           f"{turn.role} turns by this server", param="messages")
    text = "".join(b.text or "" for b in by_type.get("text", []))
    if turn.role == "user":
        results = [{"role": "tool", "tool_call_id": b.tool_use_id,
                    "content": _text(b.content, f"messages[{i}].tool_result")}
                   for b in by_type.get("tool_result", [])]
        return results + ([{"role": "user", "content": text}] if text or not results else [])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    thinking = "".join(b.thinking or "" for b in by_type.get("thinking", []))
    if thinking:
        message["reasoning_content"] = thinking
    if "tool_use" in by_type:
        message["tool_calls"] = [{"id": b.id, "type": "function", "function": {
            "name": b.name, "arguments": json.dumps(b.input or {}, ensure_ascii=False)}}
            for b in by_type["tool_use"]]
    return [message]


def _parse(model: type[CountTokensRequest], body: Any) -> tuple[Any, ChatCompletionRequest]:
    """The request and its chat request; a refusal of either is a `RequestError`."""
    try:
        req = model.model_validate(body)
        return req, ChatCompletionRequest.model_validate(req.chat_body())
    except ValidationError as exc:
        raise validation_error(exc) from None


async def _json(raw_request) -> Any:
    try:
        return await raw_request.json()
    except ValueError as exc:
        raise RequestError(f"The request body is not valid JSON: {exc}") from None


async def count_tokens(raw_request, state: EngineClient, limits: Limits):
    try:
        _, chat_req = _parse(CountTokensRequest, await _json(raw_request))
        spec = await chat.prepare(chat_req, state, limits)
        ids = await state.tokenize(TokenizeMsg(
            0, spec.messages, spec.sampling_params, chat_template_kwargs=spec.chat_template_kwargs,
            tools=spec.template_tools, add_special_tokens=spec.add_special_tokens), "messages")
    except RequestError as exc:
        return anthropic_error(exc)
    return {"input_tokens": len(ids)}


async def create_message(raw_request, state: EngineClient, limits: Limits):
    try:
        req, chat_req = _parse(MessagesRequest, await _json(raw_request))
        spec = await chat.prepare(chat_req, state, limits)
        events = message_events(await generation.generate_events(state, spec), req.model,
                                req.stop_sequences or [])
        if req.stream:
            return StreamingResponse(sse_events(events), media_type="text/event-stream")
        return await until_disconnected(raw_request, folded(events))
    except RequestError as exc:
        return anthropic_error(exc)
