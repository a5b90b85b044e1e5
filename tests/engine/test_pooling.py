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


def test_pooling_requests_take_no_row_of_the_lm_head(tiny, monkeypatch):
    """A pooling request's one token is never read: it gets no logit row, so a batch of them
    runs no LM head, and beside a generation request that request's tokens and logprobs are
    those it gets alone."""
    head_rows = []
    head = tiny.model.lm_head
    monkeypatch.setattr(head, "forward", lambda x, f=head.forward: head_rows.append(len(x)) or f(x))
    prompts = {uid: random_prompt(9 + uid, 40 + uid) for uid in range(3)}
    _embed(build_scheduler(tiny, kv_slots=1024), prompts, "last")
    assert head_rows == []
    generate = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    alone = drain(build_scheduler(tiny, kv_slots=1024), {9: (random_prompt(12, 49), generate)})
    mixed = drain(build_scheduler(tiny, kv_slots=1024), {
        **{uid: (ids, SamplingParams(temperature=0, max_tokens=1, pooling="last"))
           for uid, ids in prompts.items()},
        9: (random_prompt(12, 49), generate)})
    assert [(m.token_ids, m.logprobs) for m in mixed[9]] == [(m.token_ids, m.logprobs) for m in alone[9]]
    assert all(mixed[uid][0].embedding is not None for uid in prompts)
    assert max(head_rows) == 1  # the generation request's row alone
