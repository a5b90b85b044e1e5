"""/v1/embeddings (OpenAI's shape) on a model served with --runner pooling --convert embed.

Each input is one pooling request (engine/pooling.py): its prompt's final-norm hidden states
pooled as the model folder says. Here the vector is cut to `dimensions` (Matryoshka, where the
model declares it) and then normalised, when the model's sentence-transformers modules end
with Normalize.
"""

from __future__ import annotations

import base64
import math
import struct
import time
from typing import TYPE_CHECKING

from freetoken.core import SamplingParams
from freetoken.message import TokenizeMsg
from freetoken.serving.errors import AsciiJSONResponse, RequestError, error_from
from freetoken.serving.handling import check_model, until_disconnected
from freetoken.serving.limits import Limits
from freetoken.serving.one_step import run_all
from freetoken.serving.pooling.config import served_for
from freetoken.serving.pooling.protocol import EmbeddingRequest

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient
    from freetoken.config import PoolingConfig


def check_dimensions(dimensions: int | None, pooling: PoolingConfig) -> None:
    if dimensions is None:
        return
    allowed = pooling.matryoshka_dimensions
    if allowed is None:
        raise RequestError("dimensions is not supported by this model: it does not declare "
                           "Matryoshka embeddings (is_matryoshka / matryoshka_dimensions).",
                           param="dimensions")
    if dimensions > pooling.hidden_size or (allowed and dimensions not in allowed):
        choices = f"one of {list(allowed)}" if allowed else f"at most {pooling.hidden_size}"
        raise RequestError(f"dimensions must be {choices}, got {dimensions}.", param="dimensions")


def finish(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """Cut to `dimensions`, then normalise to unit length where the model does."""
    vector = vector[:dimensions] if dimensions else vector
    if not normalize:
        return vector
    norm = max(math.sqrt(math.fsum(v * v for v in vector)), 1e-12)  # torch's F.normalize eps
    return [v / norm for v in vector]


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def create_embeddings(req: EmbeddingRequest, raw_request, state: EngineClient,
                            limits: Limits):
    try:
        check_model(req.model, state)
        pooling = served_for(state.config, "embed")
        check_dimensions(req.dimensions, pooling)
        inputs = req.inputs
        if len(inputs) > limits.max_prompts_per_request:
            raise RequestError(f"A request may carry at most {limits.max_prompts_per_request} "
                               f"inputs; this one has {len(inputs)}.", param="input")
        for item in inputs:
            if isinstance(item, list):
                limits.check_ids(item, "input")
        # The engine computes no logits for a pooling request: it finishes on one placeholder.
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, speculative=False,
                                pooling=pooling.pooling)
        msgs = [TokenizeMsg(state.new_user(), item, params) for item in inputs]
        replies = await until_disconnected(
            raw_request, run_all(state, msgs, limits.max_running_requests))
    except RequestError as exc:
        return error_from(exc)
    tokens = sum(r.prompt_tokens_delta for r in replies)
    data = [{"object": "embedding", "index": i,
             "embedding": encode(finish(r.embedding, req.dimensions, pooling.normalize),
                                 req.encoding_format)}
            for i, r in enumerate(replies)]
    # A response, not a dict: FastAPI's jsonable_encoder would walk every float (~20 ms for 64
    # vectors of 64).
    return AsciiJSONResponse({
        "object": "list", "data": data, "model": req.model or state.config.served_model_name,
        "created": int(time.time()), "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
