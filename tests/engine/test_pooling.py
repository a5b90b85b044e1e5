"""Pooling requests (embeddings): the final-norm hidden states pooled last / mean / CLS, against
transformers float32's `last_hidden_state`; bit-identical in a batch or alone, chunked or whole,
and (last-token pooling) after a prefix-cache hit."""

from __future__ import annotations


import pytest
import torch

from freetoken.core import SamplingParams
from freetoken.scheduler.factory import build_scheduler
from tests.model_fixtures import drain, hf_reference, loaded_fp32, random_prompt, tiny_random_folder

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny():
    return loaded_fp32(tiny_random_folder("qwen3"))



def _embed(scheduler, prompts: dict[int, list[int]], mode: str) -> dict[int, list[float]]:
    params = {uid: SamplingParams(temperature=0, max_tokens=1, pooling=mode) for uid in prompts}
    msgs = drain(scheduler, {uid: (ids, params[uid]) for uid, ids in prompts.items()})
    return {uid: ms[0].embedding for uid, ms in msgs.items()}


def _reference(ids: list[int], mode: str) -> torch.Tensor:
    model = hf_reference(tiny_random_folder("qwen3"))
    with torch.no_grad():
        states = model.model(torch.tensor([ids])).last_hidden_state[0].float()
    return {"last": states[-1], "cls": states[0], "mean": states.mean(0)}[mode]


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
def test_pooled_states_match_transformers_and_do_not_depend_on_the_batch(tiny, mode):
    prompts = {uid: random_prompt(6 + 5 * uid, uid) for uid in range(4)}
    together = _embed(build_scheduler(tiny, kv_slots=1024), prompts, mode)
    chunked = _embed(build_scheduler(tiny, kv_slots=1024, max_prefill_tokens=5), prompts, mode)
    for uid, ids in prompts.items():
        alone = _embed(build_scheduler(tiny, kv_slots=256), {uid: ids}, mode)[uid]
        assert together[uid] == alone == chunked[uid]  # bit for bit
        ref = _reference(ids, mode)
        got = torch.tensor(together[uid])
        assert torch.allclose(got, ref, atol=TOLERANCE, rtol=0)
        assert torch.cosine_similarity(got, ref, dim=0) >= 0.99999


def test_last_token_pooling_takes_prefix_cache_hits_unchanged(tiny):
    base = random_prompt(30, 7)
    scheduler = build_scheduler(tiny, kv_slots=1024)
    cold = _embed(build_scheduler(tiny, kv_slots=1024, prefix_cache=False), {1: base + [5000]}, "last")
    _embed(scheduler, {0: base + [6000]}, "last")
    msgs = drain(scheduler, {1: (base + [5000], SamplingParams(temperature=0, max_tokens=1,
                                                               pooling="last"))})
    assert msgs[1][0].cached_tokens > 0 and msgs[1][0].embedding == cold[1]


def test_mean_pooling_takes_no_prefix_cache_hit(tiny):
    base = random_prompt(30, 8)
    scheduler = build_scheduler(tiny, kv_slots=1024)
    _embed(scheduler, {0: base}, "last")
    msgs = drain(scheduler, {1: (base + [5000], SamplingParams(temperature=0, max_tokens=1,
                                                               pooling="mean"))})
    assert msgs[1][0].cached_tokens == 0
    assert torch.allclose(torch.tensor(msgs[1][0].embedding), _reference(base + [5000], "mean"),
                          atol=TOLERANCE, rtol=0)
