"""`/v1/chat/completions`: validate, run `generation`'s events, shape JSON or SSE from them.

`state` is an `EngineClient` (client.py): `FrontendManager`, or a test's fake.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi.responses import StreamingResponse

from freetoken.serving import generation, structured
from freetoken.serving.api_models import ChatCompletionRequest
from freetoken.serving.errors import RequestError, error_body, error_from
from freetoken.serving.handling import (
    all_or_none,
    check_request,
    limits_of,
    merged,
    sse,
    token_texts,
    until_disconnected,
    usage_dict,
)
from freetoken.serving.logprob_format import chat_entries, vllm_prompt_logprobs
from freetoken.serving.validation import to_sampling_params

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient


async def handle_chat_completion(req: ChatCompletionRequest, raw_request, state: EngineClient,
                                 model_sampling: dict | None = None):
    try:
        check_request(req, state, model_sampling)
        spec = generation.chat_request_to_genspec(req, to_sampling_params(req, limits_of(state)), state)
        await structured.check(state, spec.sampling_params.structured, spec.structured_param)
        specs = _choice_specs(spec, req.n)
        if req.stream:
            streams = await all_or_none([generation.generate_events(state, s) for s in specs])
            return StreamingResponse(stream_chat_completion_chunks(state, req, spec, streams),
                                     media_type="text/event-stream")

        async def result_of(choice_spec: generation.GenSpec) -> generation.GenResult:
            return await generation.collect(await generation.generate_events(state, choice_spec))

        results = await until_disconnected(raw_request, all_or_none([result_of(s) for s in specs]))
    except RequestError as exc:
        return error_from(exc)
    texts, as_ids = token_texts(state), spec.sampling_params.return_tokens_as_token_ids

    def choice(index: int, result: generation.GenResult) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": result.content}
        if spec.reasoning_parser is not None:
            message["reasoning_content"] = result.reasoning or None
        if result.tool_calls:
            message["tool_calls"] = result.tool_calls
        out: dict[str, Any] = {"index": index, "message": message,
                               "finish_reason": result.finish_reason, "logprobs": None}
        if spec.logprobs:
            out["logprobs"] = {"content": chat_entries(result.content_logprobs, texts, as_ids),
                               "refusal": None}
        if spec.include_reasoning_logprobs:
            out["reasoning_logprobs"] = {"content": chat_entries(result.reasoning_logprobs, texts,
                                                                 as_ids)}
        return out

    response = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model or state.config.served_model_name,
        "choices": [choice(i, r) for i, r in enumerate(results)],
        "usage": _usage(results),
    }
    if spec.sampling_params.prompt_logprobs is not None:
        # One prompt for all choices: vLLM puts its logprobs beside the choices.
        response["prompt_logprobs"] = vllm_prompt_logprobs(results[0].prompt_logprobs or [], texts)
    return response


def _choice_specs(spec: generation.GenSpec, n: int) -> list[generation.GenSpec]:
    """One generation per choice; seeded choices draw from seed + j, as completions do."""
    params = spec.sampling_params
    if n == 1:
        return [spec]
    return [replace(spec, sampling_params=replace(
        params, seed=None if params.seed is None else params.seed + j)) for j in range(n)]


def _usage(choices: list[generation.GenResult | generation.GenDone]) -> dict:
    # The choices share one prompt: it counts once, as vLLM's.
    return usage_dict(choices[0].prompt_tokens, sum(c.completion_tokens for c in choices),
                      choices[0].cached_tokens)


async def stream_chat_completion_chunks(state, req, spec, streams) -> AsyncIterator[str]:
    texts, as_ids = token_texts(state), spec.sampling_params.return_tokens_as_token_ids
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    model = req.model or state.config.served_model_name

    def chunk(index: int, delta: dict, finish_reason=None, logprobs=None,
              reasoning_logprobs=None) -> str:
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None,
                                  "finish_reason": finish_reason}
        if spec.logprobs and logprobs is not None:
            choice["logprobs"] = {"content": chat_entries(logprobs, texts, as_ids), "refusal": None}
        if spec.include_reasoning_logprobs and reasoning_logprobs:
            choice["reasoning_logprobs"] = {"content": chat_entries(reasoning_logprobs, texts, as_ids)}
        return sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                     "model": model, "choices": [choice]})

    for index in range(len(streams)):
        yield chunk(index, {"role": "assistant", "content": ""})
    done: list[generation.GenDone] = []
    try:
        async for i, ev in merged(streams):
            if isinstance(ev, generation.ContentDelta):
                yield chunk(i, {"content": ev.text}, logprobs=ev.logprobs)
            elif isinstance(ev, generation.ReasoningDelta):
                yield chunk(i, {"reasoning_content": ev.text}, reasoning_logprobs=ev.logprobs)
            elif isinstance(ev, generation.ToolCallDelta):
                yield chunk(i, {"tool_calls": [ev.as_delta()]})
            elif isinstance(ev, generation.GenDone):
                done.append(ev)
                yield chunk(i, {}, ev.finish_reason, logprobs=ev.logprobs,
                            reasoning_logprobs=ev.reasoning_logprobs)
        if req.stream_options and req.stream_options.include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [], "usage": _usage(done)})
    except RequestError as exc:
        yield sse(error_body(exc))
    yield "data: [DONE]\n\n"
