"""Whole-label scoring: each label's total logprob after a prompt, teacher-forced through all
its tokens, and the probabilities renormalised over the label set (`/generative_scoring`, and
`labels` on `/v1/completions`).

A (prompt, label) pair is one engine request for prompt + label whose prompt logprobs start at
the label's first token (`SamplingParams.prompt_logprobs_from`): only the label's positions are
scored, and the prompt's KV may come from the prefix cache. Each prompt's first label runs before
the others, which then find the prompt cached: one prefill per prompt, its labels batched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from freetoken.core import SamplingParams
from freetoken.message import TokenizeMsg, UserReply
from freetoken.serving.errors import RequestError
from freetoken.serving.handling import usage_dict
from freetoken.serving.limits import Limits
from freetoken.serving.one_step import run_all
from freetoken.tokenizer.detokenize import TokenTexts

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient

Label = str | list[int]


@dataclass(frozen=True)
class LabelSet:
    given: list[Label]  # as the request spelled them
    ids: list[list[int]]  # each label's tokens
    tokens: list[list[str]]  # and their strings, as logprob entries name them


@dataclass(frozen=True)
class LabelScores:
    """One prompt's labels, in the set's order."""

    logprobs: list[float]  # each label's total
    probs: list[float]  # renormalised over the set


def label_set(tokenizer, given: list[Label], limits: Limits, param: str) -> LabelSet:
    """`given` as token ids, checked: a string is tokenized as the model writes it after the
    prompt (no special tokens, so mind the leading space)."""
    if not given:
        raise RequestError(f"{param} must not be empty", param=param)
    if len(given) > limits.max_labels:
        raise RequestError(f"At most {limits.max_labels} labels may be scored (--max-labels); "
                           f"got {len(given)}.", param=param)
    ids = [tokenizer.encode(g, add_special_tokens=False) if isinstance(g, str) else list(g)
           for g in given]
    seen: dict[tuple[int, ...], int] = {}
    for i, label in enumerate(ids):
        if not label:
            raise RequestError(f"{param}[{i}] has no tokens", param=param)
        limits.check_ids(label, param)
        first = seen.setdefault(tuple(label), i)
        if first != i:
            raise RequestError(f"{param}[{i}] is the same tokens as {param}[{first}]: "
                               f"{label}", param=param)
    texts = TokenTexts.of(tokenizer)
    return LabelSet(list(given), ids, [[texts.text(t) for t in label] for label in ids])


def renormalised(totals: list[float], lengths: list[int], length_normalize: bool) -> list[float]:
    """A softmax over the totals (per token where `length_normalize`), in float64."""
    values = [t / n for t, n in zip(totals, lengths)] if length_normalize else totals
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    total = math.fsum(weights)
    return [w / total for w in weights]


async def score(state: EngineClient, prompts: list[list[int]], labels: LabelSet,
                length_normalize: bool, window: int) -> tuple[list[LabelScores], dict]:
    """Every prompt's label scores, and the usage (the prompt + label tokens the engine ran,
    those the prefix cache supplied)."""
    limit = state.config.max_model_len
    longest = max(len(label) for label in labels.ids)
    for i, prompt in enumerate(prompts):
        # +1: the token each request samples (and drops) after its label.
        if len(prompt) + longest + 1 > limit:
            raise RequestError(f"Prompt {i} ({len(prompt)} tokens) and its longest label "
                               f"({longest}) exceed this model's maximum context length of "
                               f"{limit} tokens.", param="labels",
                               code="context_length_exceeded")

    def msg(prompt: list[int], label: list[int]) -> TokenizeMsg:
        params = SamplingParams(temperature=0.0, max_tokens=1, speculative=False,
                                prompt_logprobs=0, prompt_logprobs_from=len(prompt))
        return TokenizeMsg(state.new_user(), prompt + label, params)

    firsts = await run_all(state, [msg(p, labels.ids[0]) for p in prompts], window)
    rest = await run_all(state, [msg(p, label) for p in prompts for label in labels.ids[1:]],
                         window)
    per_label = len(labels.ids) - 1
    replies: list[list[UserReply]] = [[first, *rest[i * per_label : (i + 1) * per_label]]
                                      for i, first in enumerate(firsts)]
    lengths = [len(label) for label in labels.ids]
    scores = []
    for prompt_replies in replies:
        totals = [math.fsum(e.logprob for e in r.prompt_logprobs[-n:])
                  for r, n in zip(prompt_replies, lengths)]
        scores.append(LabelScores(totals, renormalised(totals, lengths, length_normalize)))
    flat = [r for prompt_replies in replies for r in prompt_replies]
    usage = usage_dict(sum(r.prompt_tokens_delta for r in flat), 0,
                       sum(r.cached_tokens for r in flat))
    return scores, usage


def entries(labels: LabelSet, scores: LabelScores) -> list[dict]:
    """A prompt's labels as the responses list them."""
    return [{"label": given, "token_ids": ids, "tokens": tokens, "logprob": lp, "prob": p}
            for given, ids, tokens, lp, p in zip(labels.given, labels.ids, labels.tokens,
                                                 scores.logprobs, scores.probs)]
