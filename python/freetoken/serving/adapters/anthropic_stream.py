"""Anthropic's stream events from chat's (`generation`): a content block per run of reasoning
(thinking), of content (text) or per tool call (tool_use). The non-streamed message is the fold
of these very events (`folded`), so the two modes cannot disagree.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any, AsyncIterator

from freetoken.serving.openai import generation
from freetoken.serving.errors import RequestError, anthropic_body


async def sse_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
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


async def message_events(events: AsyncIterator, model: str,
                         stops: list[str]) -> AsyncIterator[dict]:
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
                "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
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
            reason, sequence = _stop(ev, stops)
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
