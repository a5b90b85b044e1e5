"""`POST /generative_scoring` (vLLM's shape): each prompt's labels scored whole
(serving/openai/labels.py), `score` the first label's probability."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import TYPE_CHECKING

from freetoken.serving.errors import AsciiJSONResponse, RequestError, error_from
from freetoken.serving.handling import check_model, fingerprint, until_disconnected
from freetoken.serving.limits import Limits
from freetoken.serving.openai.labels import entries, score
from freetoken.serving.pooling.protocol import GenerativeScoringRequest

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient


async def create_generative_scoring(req: GenerativeScoringRequest, raw_request,
                                    state: EngineClient, limits: Limits):
    """vLLM's response, `score` its first label's probability (renormalised over the labels
    with `apply_softmax`, else the model's own), and every label's values under `labels`."""
    try:
        check_model(req.model, state)
        job = await asyncio.to_thread(req.to_job, state.tokenizer, limits)
        scores, usage = await until_disconnected(raw_request, score(
            state, job.prompts, job.labels, job.length_normalize, limits.max_running_requests))
    except RequestError as exc:
        return error_from(exc)
    data = [{"index": i, "object": "score",
             "score": s.probs[0] if job.apply_softmax else math.exp(s.logprobs[0]),
             "labels": entries(job.labels, s)} for i, s in enumerate(scores)]
    return AsciiJSONResponse({  # not walked by jsonable_encoder
        "id": f"generative-scoring-{uuid.uuid4().hex}", "object": "list",
        "created": int(time.time()), "model": req.model or state.config.served_model_name,
        "data": data, "usage": usage, **fingerprint(state)})
