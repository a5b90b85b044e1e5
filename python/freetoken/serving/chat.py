"""`/v1/chat/completions`: validate, run `generation`'s events, shape JSON or SSE from them.

`state` is an `EngineClient` (client.py): `FrontendManager`, or a test's fake.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi.responses import StreamingResponse

from freetoken.serving import generation
from freetoken.serving.api_models import ChatCompletionRequest
from freetoken.serving.errors import RequestError, error_body, error_from
from freetoken.serving.handling import (
    check_request,
    limits_of,
    sse,
    token_texts,
    until_disconnected,
    usage_dict,
)
from freetoken.serving.logprob_format import chat_entries
from freetoken.serving.validation import to_sampling_params

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient


async def handle_chat_completion(req: ChatCompletionRequest, raw_request, state: EngineClient,
                                 model_sampling: dict | None = None):
    try:
        check_request(req, state, model_sampling)
        spec = generation.chat_request_to_genspec(req, to_sampling_params(req, limits_of(state)), state)
        if req.stream:
            events = await generation.generate_events(state, spec)
            return StreamingResponse(stream_chat_completion_chunks(state, req, spec, events),
                                     media_type="text/event-stream")

        async def result_of_chat():
            return await generation.collect(await generation.generate_events(state, spec))

        result = await until_disconnected(raw_request, result_of_chat())
    except RequestError as exc:
        return error_from(exc)
    texts, as_ids = token_texts(state), spec.sampling_params.return_tokens_as_token_ids
    message: dict[str, Any] = {"role": "assistant", "content": result.content}
    if spec.reasoning_parser is not None:
        message["reasoning_content"] = result.reasoning or None
    if result.tool_calls:
        message["tool_calls"] = result.tool_calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": result.finish_reason,
                              "logprobs": None}
    if spec.logprobs:
        choice["logprobs"] = {"content": chat_entries(result.content_logprobs, texts, as_ids),
                              "refusal": None}
    if spec.include_reasoning_logprobs:
        choice["reasoning_logprobs"] = {"content": chat_entries(result.reasoning_logprobs, texts, as_ids)}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model or state.config.served_model_name,
        "choices": [choice],
        "usage": usage_dict(result.prompt_tokens, result.completion_tokens, result.cached_tokens),
    }


async def stream_chat_completion_chunks(state, req, spec, events) -> AsyncIterator[str]:
    texts, as_ids = token_texts(state), spec.sampling_params.return_tokens_as_token_ids
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    model = req.model or state.config.served_model_name

    def chunk(delta: dict, finish_reason=None, logprobs=None, reasoning_logprobs=None) -> str:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish_reason}
        if spec.logprobs and logprobs is not None:
            choice["logprobs"] = {"content": chat_entries(logprobs, texts, as_ids), "refusal": None}
        if spec.include_reasoning_logprobs and reasoning_logprobs:
            choice["reasoning_logprobs"] = {"content": chat_entries(reasoning_logprobs, texts, as_ids)}
        return sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                     "model": model, "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for ev in events:
            if isinstance(ev, generation.ContentDelta):
                yield chunk({"content": ev.text}, logprobs=ev.logprobs)
            elif isinstance(ev, generation.ReasoningDelta):
                yield chunk({"reasoning_content": ev.text}, reasoning_logprobs=ev.logprobs)
            elif isinstance(ev, generation.ToolCallDelta):
                yield chunk({"tool_calls": [ev.as_delta()]})
            elif isinstance(ev, generation.GenDone):
                yield chunk({}, ev.finish_reason, logprobs=ev.logprobs,
                            reasoning_logprobs=ev.reasoning_logprobs)
                if req.stream_options and req.stream_options.include_usage:
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                                "model": model, "choices": [],
                                "usage": usage_dict(ev.prompt_tokens, ev.completion_tokens,
                                                    ev.cached_tokens)})
    except RequestError as exc:
        yield sse(error_body(exc))
    yield "data: [DONE]\n\n"
