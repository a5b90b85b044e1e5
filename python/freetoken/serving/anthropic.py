"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) as an adapter over
chat: the request becomes a `ChatCompletionRequest` (the same conversation, so the same prompt
and the same answer as `/v1/chat/completions`), runs through `chat.prepare` and `generation`,
and its events become Anthropic's content blocks. The non-streamed message is the fold of the
streamed events, so the two modes cannot disagree. Errors take Anthropic's shape.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Literal

from fastapi.responses import StreamingResponse
from pydantic import Field, StrictBool, StrictInt, ValidationError, model_validator

from freetoken.message import TokenizeMsg
from freetoken.serving import chat, generation
from freetoken.serving.errors import RequestError, anthropic_body, anthropic_error
from freetoken.serving.errors import validation_error
from freetoken.serving.handling import until_disconnected
from freetoken.serving.limits import Limits
from freetoken.serving.messages import OpenAIBaseModel
from freetoken.serving.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient

# Accepted because they cannot change the generated result.
HARMLESS_FIELDS = {"metadata", "service_tier", "container", "mcp_servers", "cache_control"}


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
        events = _message_events(await generation.generate_events(state, spec), req)
        if req.stream:
            return StreamingResponse(_sse(events), media_type="text/event-stream")
        return await until_disconnected(raw_request, folded(events))
    except RequestError as exc:
        return anthropic_error(exc)


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
    except RequestError as exc:
        yield f"event: error\ndata: {json.dumps(anthropic_body(exc))}\n\n"


def _stop(done: generation.GenDone, stops: list[str]) -> tuple[str, str | None]:
    if done.finish_reason == "tool_calls":
        return "tool_use", None
    if done.finish_reason == "length":
        return "max_tokens", None
    if isinstance(done.matched_stop, str) and done.matched_stop in stops:
        return "stop_sequence", done.matched_stop
    return "end_turn", None


def signature(thinking: str) -> str:
    """A thinking block's `signature`: the SHA-256 of its text. Not a secret: replayed thinking
    is rendered as it comes back, never checked."""
    return hashlib.sha256(thinking.encode()).hexdigest()


async def _message_events(events: AsyncIterator, req: MessagesRequest) -> AsyncIterator[dict]:
    """Anthropic's stream events from chat's: a block per run of reasoning (thinking), content
    (text) or one tool call (tool_use)."""
    index, kind, thinking = -1, None, []

    def close() -> list[dict]:
        out = []
        if kind == "thinking":
            out.append({"type": "content_block_delta", "index": index, "delta": {
                "type": "signature_delta", "signature": signature("".join(thinking))}})
        return out + [{"type": "content_block_stop", "index": index}] if kind else []

    def switch(new_kind: Any, block: dict) -> list[dict]:
        nonlocal index, kind
        if new_kind == kind:
            return []
        out = close()
        index, kind = index + 1, new_kind
        thinking.clear()
        return out + [{"type": "content_block_start", "index": index, "content_block": block}]

    async for ev in events:
        if isinstance(ev, generation.GenStart):
            yield {"type": "message_start", "message": {
                "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "model": req.model, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": ev.prompt_tokens, "output_tokens": 0}}}
        elif isinstance(ev, generation.ReasoningDelta):
            for out in switch("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                yield out
            thinking.append(ev.text)
            yield {"type": "content_block_delta", "index": index,
                   "delta": {"type": "thinking_delta", "thinking": ev.text}}
        elif isinstance(ev, generation.ContentDelta):
            for out in switch("text", {"type": "text", "text": ""}):
                yield out
            yield {"type": "content_block_delta", "index": index,
                   "delta": {"type": "text_delta", "text": ev.text}}
        elif isinstance(ev, generation.ToolCallDelta):
            for out in switch(("tool_use", ev.index), {"type": "tool_use", "id": ev.id,
                                                       "name": ev.name, "input": {}}):
                yield out
            if ev.arguments:
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": ev.arguments}}
        elif isinstance(ev, generation.GenDone):
            for out in close():
                yield out
            reason, sequence = _stop(ev, req.stop_sequences or [])
            yield {"type": "message_delta",
                   "delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": {"input_tokens": ev.prompt_tokens,
                             "output_tokens": ev.completion_tokens}}
            yield {"type": "message_stop"}


async def folded(events: AsyncIterator[dict]) -> dict:
    """The message the events build, as a client joining the stream does."""
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    async for ev in events:
        kind = ev["type"]
        if kind == "message_start":
            message = ev["message"]
        elif kind == "content_block_start":
            message["content"].append(dict(ev["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][ev["index"]], ev["delta"]
            if delta["type"] == "input_json_delta":
                partial[ev["index"]] = partial.get(ev["index"], "") + delta["partial_json"]
            else:
                field = {"text_delta": "text", "thinking_delta": "thinking",
                         "signature_delta": "signature"}[delta["type"]]
                block[field] = block.get(field, "") + delta[field]
        elif kind == "content_block_stop" and ev["index"] in partial:
            # The parsers close a call's arguments even when the output is cut short.
            message["content"][ev["index"]]["input"] = json.loads(partial[ev["index"]])
        elif kind == "message_delta":
            message.update(ev["delta"])
            message["usage"].update(ev["usage"])
    return message
