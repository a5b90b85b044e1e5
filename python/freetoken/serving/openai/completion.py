"""`/v1/completions`: the request's sampling params and prompts, every prompt x n submitted,
JSON or SSE shaped from the replies. `state` is an `EngineClient` (client.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, AsyncIterator

from fastapi.responses import StreamingResponse

from freetoken.core import SamplingParams, TokenLogprob
from freetoken.message import TokenizeMsg, UserReply
from freetoken.serving.openai import labels, structured
from freetoken.serving.errors import RequestError, error_body, error_from, reply_error
from freetoken.serving.handling import (
    all_or_none,
    check_model,
    fingerprint,
    sampling_defaults_refused,
    sse,
    token_texts,
    until_disconnected,
    usage_dict,
)
from freetoken.serving.limits import Limits
from freetoken.serving.logprob_format import (
    completion_logprobs,
    prompt_items,
    vllm_prompt_logprobs,
)
from freetoken.serving.openai.protocol import CompletionRequest

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient


@dataclass
class Choice:
    """One completion choice as it accumulates replies."""

    index: int
    uid: int
    prefix: str = ""  # the echoed prompt
    echo_only: bool = False  # `echo` with `max_tokens: 0`: the generated token is dropped
    counts_prompt: bool = True  # the first of its prompt's n choices: usage counts the prompt once
    text: str = ""
    entries: list[TokenLogprob] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    prompt_entries: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, reply: UserReply) -> tuple[str, list[TokenLogprob]]:
        """Take `reply` in; returns the text and logprob entries it adds to the choice."""
        if reply.error:
            raise reply_error(reply.error, reply.error_code)
        if reply.prompt_logprobs is not None:
            self.prompt_entries, self.prompt_ids = reply.prompt_logprobs, reply.prompt_token_ids or []
        text = "" if self.echo_only else reply.incremental_output
        entries = [] if self.echo_only else [e for e in [*reply.logprobs, reply.stop_logprob]
                                             if e is not None]
        self.text += text
        self.entries += entries
        self.prompt_tokens += reply.prompt_tokens_delta
        self.completion_tokens += reply.completion_tokens_delta
        self.cached_tokens = max(self.cached_tokens, reply.cached_tokens)
        if reply.finished:
            self.finish_reason = reply.finish_reason
        return text, entries

    def echoed_items(self, echo: bool) -> list[TokenLogprob | int]:
        """The echoed prompt's logprob items, which come before the generated ones."""
        if not echo or self.prompt_entries is None:
            return []
        return prompt_items(self.prompt_ids, self.prompt_entries)


async def handle_completion(req: CompletionRequest, raw_request, state: EngineClient,
                            model_sampling: dict | None = None):
    """Upstream FreeToken's handler signature, for callers of the handler itself: the limits
    come from `state.config`. `raw_request`: the Starlette request, watched for a client that
    leaves (None when there is none)."""
    if model_sampling:
        return sampling_defaults_refused()
    return await create_completion(req, raw_request, state, Limits.of(state.config))


async def create_completion(req: CompletionRequest, raw_request, state: EngineClient,
                            limits: Limits):
    try:
        check_model(req.model, state)
        params = req.to_sampling_params(limits)
        found = req.structured_output
        await structured.check(state, params.structured, found.field if found else None)
        prompts = req.prompts(limits)
        if req.labels is not None:
            label_set = await asyncio.to_thread(labels.label_set, state.tokenizer, req.labels,
                                                limits, "labels")
            prompt_ids = [p if isinstance(p, list) else await state.tokenize(
                TokenizeMsg(0, p, None, add_special_tokens=req.add_special_tokens), "prompt")
                for p in prompts]
        choices, msgs = _completion_choices(state, req, prompts, params)
        # A request's prompts enter the engine a window at a time, so that one request with many
        # prompts does not queue ahead of every request that arrives after it.
        window = limits.max_running_requests
        streams = _choice_streams(state, msgs, asyncio.Semaphore(window))
        if req.stream:
            return await stream_completion_chunks(state, req, params, choices, streams, window)
        work = [_drain(c, replies) for c, replies in zip(choices, streams)]
        if req.labels is not None:
            work.append(labels.score(state, prompt_ids, label_set, False, window))
        results = await until_disconnected(raw_request, all_or_none(work))
        label_scores = results[-1][0] if req.labels is not None else None  # usage not counted
    except RequestError as exc:
        return error_from(exc)
    texts = token_texts(state)

    def choice(c: Choice) -> dict:
        out = {"index": c.index, "text": c.prefix + c.text, "logprobs": None,
               "finish_reason": c.finish_reason}
        if params.logprobs is not None:
            out["logprobs"] = completion_logprobs(c.echoed_items(req.echo) + c.entries, texts,
                                                  params.return_tokens_as_token_ids)[0]
        if params.prompt_logprobs is not None:
            out["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_entries or [], texts)
        if label_scores is not None:
            out["label_logprobs"] = labels.entries(label_set, label_scores[c.index // req.n])
        return out

    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model or state.config.served_model_name,
        "choices": [choice(c) for c in choices],
        "usage": _sum_usage(choices),
        **fingerprint(state),
    }


def _sum_usage(choices: list[Choice]) -> dict:
    # The n choices of a prompt share it: its tokens (and cache hits) count once, as vLLM.
    firsts = [c for c in choices if c.counts_prompt]
    return usage_dict(sum(c.prompt_tokens for c in firsts),
                      sum(c.completion_tokens for c in choices),
                      sum(c.cached_tokens for c in firsts))


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
            msgs.append(TokenizeMsg(uid, prompt, replace(params, seed=seed),
                                    add_special_tokens=req.add_special_tokens))
            choices.append(Choice(index=p_index * req.n + j, uid=uid, prefix=prefix,
                                  echo_only=req.echo_only, counts_prompt=j == 0))
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
        return sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                     "choices": choices_payload, **fingerprint(state), **extra})

    async def body():
        echoed: set[int] = set()
        try:
            async for c, reply in replies:
                text, entries = c.add(reply)
                if req.echo and c.uid not in echoed:
                    # The echoed prompt (and its logprobs) leads the choice's first chunk, as vLLM.
                    echoed.add(c.uid)
                    text, entries = c.prefix + text, [*c.echoed_items(True), *entries]
                logprobs = None
                if params.logprobs is not None:
                    logprobs, offsets[c.uid] = completion_logprobs(entries, texts, as_ids, offsets[c.uid])
                if not text and not reply.finished and not entries:
                    continue
                yield chunk([{"index": c.index, "text": text,
                              "logprobs": logprobs, "finish_reason": c.finish_reason}])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage=_sum_usage(choices))
        except RequestError as exc:
            yield sse(error_body(exc))
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
