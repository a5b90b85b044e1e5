"""What the completion and chat handlers share: the model check, disconnect watching, usage and
SSE framing."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi.responses import JSONResponse

from freetoken.serving.errors import RequestError, error_from
from freetoken.tokenizer.detokenize import TokenTexts

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient


def token_texts(state: EngineClient) -> TokenTexts | None:
    tokenizer = getattr(state, "tokenizer", None)  # optional: `EngineClient` does not require it
    return TokenTexts.of(tokenizer) if tokenizer is not None else None


def check_model(name: str | None, state: EngineClient) -> None:
    """A request naming another model than the one served is a 404."""
    if name is not None and name != state.config.served_model_name:
        raise RequestError(f"The model `{name}` does not exist.", param="model",
                           code="model_not_found", status=404)


def fingerprint(state: EngineClient) -> dict:
    """The response's `system_fingerprint` where the server's arithmetic is not the exact one
    (`--quantized-arithmetic int8`: a client tells such scores apart), else nothing."""
    value = getattr(state.config, "system_fingerprint", None)
    return {"system_fingerprint": value} if value else {}


def sampling_defaults_refused() -> JSONResponse:
    """The answer to a caller of the handlers that passes per-model sampling defaults (the
    handlers' fourth argument, `model_sampling`): this server has none to apply, and says so
    rather than ignore them."""
    return error_from(RequestError("per-model sampling defaults are not supported by this "
                                   "server", status=500, code="engine_error"))


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


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


async def all_or_none(coros: list) -> list:
    """Run `coros` together; the first error cancels the rest (whose requests are then aborted
    by `wait_for_ack`) instead of leaving them running for nobody."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """The items of all `streams` as they arrive, each with its stream's index. The first error
    in any stream is raised here, and leaving early stops them all."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, end))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is end:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


