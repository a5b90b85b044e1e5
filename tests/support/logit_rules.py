"""vLLM's logit-processor rules (bad_words, min_tokens, logit_bias, penalties) spelled out id by
id in float64: the reference the engine's batched processors are checked against."""

from __future__ import annotations

import math

import torch

from freetoken.core import SamplingParams

_INF = math.inf


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
              eos: tuple[int, ...] = ()) -> torch.Tensor:
    """vLLM's rules for one row, spelled out id by id, in float64."""
    x = logits.double().clone()
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if len(word) <= len(output) + 1 and output[len(output) - len(prefix):] == prefix:
            x[word[-1]] = -_INF
    if len(output) < p.min_tokens:
        for t in p.stop_token_ids + ([] if p.ignore_eos else list(eos)):
            x[t] = -_INF
    for t, bias in (p.logit_bias or {}).items():
        x[t] += bias
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x
