"""/rerank (also /v1/rerank, /v2/rerank) and /score on a causal-LM reranker (--convert classify).

A (query, document) pair is rendered through the score template (or, without one, tokenized as
a text pair), and scored as a one-token completion: greedy, `allowed_token_ids` the [false, true]
labels, so its logprobs are renormalised over them, and `logprob_token_ids` the true label. Its
score is exp of that: p(true) / (p(true) + p(false)) at the last position. Each query's first
pair runs before its others, which then find the query's prefix in the prefix cache; the others
reach the engine together (one_step.run_all) and run in as few steps as its prefill budget allows.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import TYPE_CHECKING

from freetoken.core import SamplingParams
from freetoken.message import TokenizeMsg
from freetoken.serving.errors import AsciiJSONResponse, RequestError, error_from
from freetoken.serving.handling import check_model, until_disconnected, usage_dict
from freetoken.serving.one_step import run_all
from freetoken.serving.pooling.config import served_for
from freetoken.serving.pooling.protocol import RerankRequest, ScoreRequest

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient


def label_id(tokenizer, label: str) -> int:
    """A `classifier_from_token` label as its vocabulary id (vLLM's reading of it)."""
    token = tokenizer.convert_tokens_to_ids(label)
    if token is None or token == tokenizer.unk_token_id:
        ids = tokenizer.encode(label, add_special_tokens=False)
        if len(ids) != 1:
            raise RequestError(f"classifier_from_token {label!r} is not one token",
                               status=500, code="engine_error")
        token = ids[0]
    return token


def pair_prompt(tokenizer, template: str | None, query: str, document: str) -> list[int]:
    if template is None:  # vLLM's default for a pair: the tokenizer's text pair
        return tokenizer(text=query, text_pair=document)["input_ids"]
    text = tokenizer.apply_chat_template(
        [{"role": "query", "content": query}, {"role": "document", "content": document}],
        chat_template=template, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


async def score_pairs(state: EngineClient, pairs: list[tuple[str, str]],
                      window: int) -> tuple[list[float], dict]:
    """Each pair's score, and the usage (prompt tokens, those found in the prefix cache), all
    pairs in the engine at once (a window of them at a time)."""
    pooling = served_for(state.config, "classify")
    tokenizer = state.tokenizer
    false_id, true_id = (label_id(tokenizer, label) for label in pooling.label_tokens)
    prompts = await asyncio.to_thread(
        lambda: [pair_prompt(tokenizer, pooling.score_template, q, d) for q, d in pairs])
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, speculative=False,
                            allowed_token_ids=[false_id, true_id], logprob_token_ids=[true_id])
    msgs = [TokenizeMsg(state.new_user(), ids, params) for ids in prompts]
    # Each query's first pair runs first: sent together, the others would each compute the
    # query's prefix in the same step; after it, they find it in the prefix cache.
    lead = sorted({q: i for i, (q, _) in reversed(list(enumerate(pairs)))}.values())
    rest = sorted(set(range(len(pairs))) - set(lead))
    replies = [None] * len(pairs)
    for wave in (lead, rest):
        for i, reply in zip(wave, await run_all(state, [msgs[i] for i in wave], window)):
            replies[i] = reply
    tokens = sum(r.prompt_tokens_delta for r in replies)
    return ([math.exp(r.logprobs[0].top_logprobs[0]) for r in replies],
            usage_dict(tokens, 0, sum(r.cached_tokens for r in replies)))


async def create_rerank(req: RerankRequest, raw_request, state: EngineClient, window: int):
    try:
        check_model(req.model, state)
        texts = req.texts
        scores, usage = await until_disconnected(
            raw_request, score_pairs(state, [(req.query, d) for d in texts], window))
    except RequestError as exc:
        return error_from(exc)
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[: req.top_n or len(texts)]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return AsciiJSONResponse({"id": f"rerank-{uuid.uuid4().hex}",  # not walked by jsonable_encoder
                              "model": req.model or state.config.served_model_name,
                              "results": results, "usage": usage})


async def create_score(req: ScoreRequest, raw_request, state: EngineClient, window: int):
    try:
        check_model(req.model, state)
        scores, usage = await until_disconnected(raw_request, score_pairs(state, req.pairs, window))
    except RequestError as exc:
        return error_from(exc)
    return AsciiJSONResponse({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": req.model or state.config.served_model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": usage})
