"""Embeddings: a pooling request (`SamplingParams.pooling`) collects the final-norm hidden states
of the prompt positions its pooling reads, as its prefill chunks run, and is answered with them
pooled on its first (and only) message.

- "last": the last prompt token's state (Qwen3-Embedding and other decoder embedders);
- "cls": the first token's;
- "mean": the mean over the prompt's tokens. Every position's state is kept and the mean taken
  once over all of them in order, so the result does not depend on how the prompt was chunked;
  these requests take no prefix-cache hit (cached positions have no hidden states).

A position's state does not depend on the rest of the batch (the engine's batch invariance), so
an embedding computed in a batch is bit-identical to the one computed alone. The vector goes
back raw (float32); normalisation and Matryoshka truncation are the frontend's.
"""

from __future__ import annotations

import torch

from freetoken.core import Req

POOLING_MODES = ("last", "mean", "cls")


def needs_every_position(params) -> bool:
    """Whether the request reads positions a prefix-cache hit would skip."""
    return params.pooling in ("mean", "cls")


def positions(req: Req, start: int, count: int) -> list[int]:
    """The prompt positions in [start, start + count) whose states `req`'s pooling reads."""
    last = len(req.prompt_ids) - 1
    mode = req.params.pooling
    if mode == "mean":
        return list(range(start, min(start + count, last + 1)))
    target = 0 if mode == "cls" else last
    return [target] if start <= target < start + count else []


def collect(req: Req, states: torch.Tensor, at: list[int]) -> None:
    """Keep `states` [len(at), H], the states of positions `at`; a recomputed position (after a
    preemption) replaces its earlier state."""
    if req.hidden is None:
        req.hidden = {}
    for position, state in zip(at, states.float().cpu()):
        req.hidden[position] = state


def pooled(req: Req) -> list[float]:
    """The request's embedding, from every state it collected; clears them."""
    hidden, req.hidden = req.hidden or {}, None
    stacked = torch.stack([hidden[p] for p in sorted(hidden)])
    vector = stacked.mean(dim=0) if req.params.pooling == "mean" else stacked[-1]
    return vector.tolist()
