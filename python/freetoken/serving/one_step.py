"""Requests that the engine answers in one step each (rerank, score, labels, embeddings): all
sent at once, a window of them at a time, each read to its end; the first error ends them all."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from freetoken.message import TokenizeMsg, UserReply
from freetoken.serving.errors import reply_error
from freetoken.serving.handling import all_or_none

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient


async def run_all(state: EngineClient, msgs: list[TokenizeMsg], window: int) -> list[UserReply]:
    """Each message's replies merged into one: prompt tokens summed, logprobs, prompt logprobs
    and embedding kept. The first window goes to the engine as one message where the client
    can send one (`send_many`: the server's; a minimal client sends each), so that it meets in
    one step; the rest follow one by one as places free."""
    gate = asyncio.Semaphore(window)
    together = msgs[:window] if hasattr(state, "send_many") else []
    if together:
        await state.send_many(together)
    sent = {msg.uid for msg in together}

    async def one(msg: TokenizeMsg) -> UserReply:
        async with gate:
            if msg.uid not in sent:
                await state.send_one(msg)
            merged = UserReply(msg.uid)
            async for reply in state.wait_for_ack(msg.uid):
                if reply.error:
                    raise reply_error(reply.error, reply.error_code)
                merged.prompt_tokens_delta += reply.prompt_tokens_delta
                merged.cached_tokens = max(merged.cached_tokens, reply.cached_tokens)
                merged.logprobs += [e for e in [*reply.logprobs, reply.stop_logprob] if e is not None]
                merged.embedding = reply.embedding or merged.embedding
                merged.prompt_logprobs = reply.prompt_logprobs or merged.prompt_logprobs
            return merged

    try:
        return await all_or_none([one(m) for m in msgs])
    finally:  # a request sent together whose reader never started (a no-op for the others)
        for uid in sent:
            await state.abort_user(uid)
