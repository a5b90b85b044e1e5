"""OpenAI handlers: validate, submit, and shape JSON or SSE from the frontend's replies.

`state` is an `EngineClient` (api_server.py): `FrontendManager`, or a test's fake.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi.responses import StreamingResponse

from freetoken.core import SamplingParams, TokenLogprob
from freetoken.message import TokenizeMsg, UserReply
from freetoken.server import generation
from freetoken.server.api_models import ChatCompletionRequest, CompletionRequest
from freetoken.server.errors import RequestError, error_body, error_from, reply_error
from freetoken.server.logprob_format import chat_entries, completion_logprobs
from freetoken.server.validation import (
    Limits,
    prompt_list,
    to_sampling_params,
    unsupported_reason,
)
from freetoken.tokenizer.detokenize import TokenTexts

if TYPE_CHECKING:
    from freetoken.server.api_server import EngineClient


def limits_of(state: EngineClient) -> Limits:
    # A fake state's config may carry only some of FrontendConfig's fields (upstream's has two).
    cfg = state.config
    return Limits(
        vocab_size=getattr(cfg, "vocab_size", None),
        max_logprobs=getattr(cfg, "max_logprobs", 20),
        max_output_tokens=getattr(cfg, "max_output_tokens", None),
        return_tokens_as_token_ids=getattr(cfg, "return_tokens_as_token_ids", False),
        max_prompts_per_request=getattr(cfg, "max_prompts_per_request", 1024),
    )


def token_texts(state: EngineClient) -> TokenTexts | None:
    tokenizer = getattr(state, "tokenizer", None)  # not part of EngineClient: fakes lack it
    return TokenTexts.of(tokenizer) if tokenizer is not None else None


def check_model(req, state) -> None:
    name = state.config.served_model_name
    if req.model is not None and req.model != name:
        raise RequestError(f"The model `{req.model}` does not exist.", param="model",
                           code="model_not_found", status=404)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


@dataclass
class Choice:
    """One completion choice as it accumulates replies."""

    index: int
    uid: int
    prefix: str = ""  # the echoed prompt
    text: str = ""
    entries: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, reply: UserReply) -> None:
        if reply.error:
            raise reply_error(reply.error, reply.error_code)
        self.text += reply.incremental_output
        self.entries += [e for e in [*reply.logprobs, reply.stop_logprob] if e is not None]
        self.prompt_tokens += reply.prompt_tokens_delta
        self.completion_tokens += reply.completion_tokens_delta
        self.cached_tokens = max(self.cached_tokens, reply.cached_tokens)
        if reply.finished:
            self.finish_reason = reply.finish_reason


def check_sampling_defaults(model_sampling: dict | None) -> None:
    """Upstream passes per-model sampling defaults (its `--sampling-defaults model`); this server
    has none, so a caller that passes some is told rather than ignored."""
    if model_sampling:
        raise RequestError("per-model sampling defaults are not supported by this server",
                           status=500, code="engine_error")


async def handle_completion(req: CompletionRequest, raw_request, state: EngineClient,
                            model_sampling: dict | None = None):
    """`raw_request`: the Starlette request, watched for a client that leaves (None in tests)."""
    try:
        check_sampling_defaults(model_sampling)
        check_model(req, state)
        if (err := unsupported_reason(req)) is not None:
            raise err
        limits = limits_of(state)
        params = to_sampling_params(req, limits)
        choices, msgs = _completion_choices(state, req, prompt_list(req, limits), params)
        # A request's prompts enter the engine a window at a time, so that one request with many
        # prompts does not queue ahead of every request that arrives after it.
        window = getattr(state.config, "max_running_requests", 64)  # fakes may lack it
        streams = _choice_streams(state, msgs, asyncio.Semaphore(window))
        if req.stream:
            return await stream_completion_chunks(state, req, params, choices, streams, window)
        await until_disconnected(raw_request, _all_or_none(
            [_drain(c, replies) for c, replies in zip(choices, streams)]))
    except RequestError as exc:
        return error_from(exc)
    texts = token_texts(state)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model or state.config.served_model_name,
        "choices": [
            {
                "index": c.index,
                "text": c.prefix + c.text,
                "logprobs": completion_logprobs(c.entries, texts, params.return_tokens_as_token_ids)[0]
                if params.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": _sum_usage(choices),
    }


def _sum_usage(choices: list[Choice]) -> dict:
    return usage_dict(sum(c.prompt_tokens for c in choices),
                      sum(c.completion_tokens for c in choices),
                      sum(c.cached_tokens for c in choices))


def _completion_choices(state, req: CompletionRequest, prompts,
                        params: SamplingParams) -> tuple[list[Choice], list[TokenizeMsg]]:
    """One choice and one engine request per prompt x n."""
    choices, msgs = [], []
    tokenizer = getattr(state, "tokenizer", None)
    for p_index, prompt in enumerate(prompts):
        prefix = ""
        if req.echo:
            prefix = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        for j in range(req.n):
            # Choices of one prompt must differ: each draws from its own seed.
            seed = None if params.seed is None else params.seed + j
            uid = state.new_user()
            msgs.append(TokenizeMsg(uid, prompt, replace(params, seed=seed)))
            choices.append(Choice(index=p_index * req.n + j, uid=uid, prefix=prefix))
    return choices, msgs


def _choice_streams(state, msgs: list[TokenizeMsg], window: asyncio.Semaphore):
    async def replies(msg: TokenizeMsg) -> AsyncIterator[UserReply]:
        async with window:
            await state.send_one(msg)
            async for reply in state.wait_for_ack(msg.uid):
                yield reply

    return [replies(m) for m in msgs]


async def _drain(choice: Choice, replies: AsyncIterator[UserReply]) -> None:
    async for reply in replies:
        choice.add(reply)


async def _all_or_none(coros: list) -> list:
    """Run `coros` together; the first error cancels the rest (whose requests are then aborted
    by `wait_for_ack`) instead of leaving them running for nobody."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


DISCONNECT_POLL_S = 0.5


async def until_disconnected(raw_request, awaitable):
    """Await `awaitable`, cancelling it if the client goes away meanwhile: a non-streaming
    client that gives up must not leave its requests running (a stream learns it on write)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while raw_request is not None:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await raw_request.is_disconnected():
                raise RequestError("The client disconnected", code="client_disconnected", status=499)
        return await task
    finally:
        task.cancel()


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _merged_replies(choices: list[Choice], streams, window: int):
    """Replies of all choices in arrival order. The first reply of each choice in the first
    window is read before streaming starts, so an error such as an over-long prompt is still
    a plain 400."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice, replies) -> None:
        try:
            async for reply in replies:
                queue.put_nowait((c, reply))
        finally:
            queue.put_nowait((c, None))

    tasks = [asyncio.create_task(pump(c, s)) for c, s in zip(choices, streams)]
    try:
        awaited, early = {c.uid for c in choices[:window]}, []
        while awaited:
            c, reply = await queue.get()
            early.append((c, reply))
            awaited.discard(c.uid)
            if reply is not None and reply.error:
                c.add(reply)  # raises RequestError
    except BaseException:
        for t in tasks:
            t.cancel()
        raise

    async def generator():
        open_choices = len(choices)
        try:
            for c, reply in early:
                open_choices -= reply is None
                if reply is not None:
                    yield c, reply
            while open_choices:
                c, reply = await queue.get()
                if reply is None:
                    open_choices -= 1
                else:
                    yield c, reply
        finally:
            for t in tasks:
                t.cancel()

    return generator()


async def stream_completion_chunks(state, req, params: SamplingParams, choices: list[Choice],
                                   streams, window: int):
    replies = await _merged_replies(choices, streams, window)
    texts, as_ids = token_texts(state), params.return_tokens_as_token_ids
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    model = req.model or state.config.served_model_name
    offsets = {c.uid: 0 for c in choices}

    def chunk(choices_payload: list[dict], **extra) -> str:
        return _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                     "choices": choices_payload, **extra})

    async def body():
        for c in choices:
            if c.prefix:  # echo: the prompt text comes first, as its own chunk
                yield chunk([{"index": c.index, "text": c.prefix, "logprobs": None,
                              "finish_reason": None}])
        try:
            async for c, reply in replies:
                c.add(reply)
                logprobs = None
                if params.logprobs is not None:
                    entries = [e for e in [*reply.logprobs, reply.stop_logprob] if e is not None]
                    logprobs, offsets[c.uid] = completion_logprobs(entries, texts, as_ids, offsets[c.uid])
                if not reply.incremental_output and not reply.finished and not reply.logprobs:
                    continue
                yield chunk([{"index": c.index, "text": reply.incremental_output,
                              "logprobs": logprobs, "finish_reason": c.finish_reason}])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage=_sum_usage(choices))
        except RequestError as exc:
            yield _sse(error_body(exc))
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def handle_chat_completion(req: ChatCompletionRequest, raw_request, state: EngineClient,
                                 model_sampling: dict | None = None):
    try:
        check_sampling_defaults(model_sampling)
        check_model(req, state)
        if (err := unsupported_reason(req)) is not None:
            raise err
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
        return _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
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
                    yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                                "model": model, "choices": [],
                                "usage": usage_dict(ev.prompt_tokens, ev.completion_tokens,
                                                    ev.cached_tokens)})
    except RequestError as exc:
        yield _sse(error_body(exc))
    yield "data: [DONE]\n\n"
