"""Prompt logprobs (SamplingParams.prompt_logprobs): exact against transformers in float32,
through the prefix cache and chunked prefill, and bit-identical whatever shares the batch."""

from __future__ import annotations

import math
import random

import pytest
import torch

from freetoken.core import SamplingParams
from freetoken.message import DetokenizeMsg
from freetoken.models.registry import load_model
from freetoken.scheduler.factory import build_scheduler
from tests.model_fixtures import drain, hf_reference, tiny_random_folder

K = 5
# HF's and our kernels round differently; measured max difference ~2e-6.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny():
    return load_model(str(tiny_random_folder("qwen3")), dtype="float32", device="cpu")


def _prompt(n: int, seed: int = 0) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1000, 40000) for _ in range(n)]


def _params(prompt_logprobs: int | None = K, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2,
                          prompt_logprobs=prompt_logprobs, **kw)


_run = drain


def _hf_logprobs(ids: list[int]) -> torch.Tensor:
    """Row p - 1 is transformers' distribution of prompt token p."""
    with torch.no_grad():
        logits = hf_reference(tiny_random_folder("qwen3"))(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _assert_matches_hf(ids: list[int], entries, k: int = K) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    ref = _hf_logprobs(ids)
    diffs = []
    for p in range(1, len(ids)):
        entry, row = entries[p], ref[p - 1]
        target = row[ids[p]].item()
        assert entry.token_id == ids[p]
        diffs.append(abs(entry.logprob - target))
        # Rank and top-K ids are exact up to ids whose logprobs lie within the tolerance.
        surely_above, maybe_above = (int((row > target + d).sum()) for d in (TOLERANCE, -TOLERANCE))
        assert surely_above + 1 <= entry.rank <= maybe_above + 1
        assert len(entry.top_ids) == len(entry.top_logprobs) == k
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
        ref_top, at_ids = row.topk(k).values.tolist(), row[entry.top_ids].tolist()
        diffs += [abs(a - b) for a, b in zip(entry.top_logprobs, ref_top)]
        diffs += [abs(a - b) for a, b in zip(entry.top_logprobs, at_ids)]
    assert max(diffs, default=0.0) <= TOLERANCE


def _prompt_entries(msgs: list[DetokenizeMsg]):
    assert all(m.prompt_logprobs is None for m in msgs[1:])
    return msgs[0].prompt_logprobs


def test_cold_prompt_matches_hf(tiny):
    ids = _prompt(20)
    out = _run(build_scheduler(tiny, kv_slots=256), {0: (ids, _params())})
    _assert_matches_hf(ids, _prompt_entries(out[0]))


def test_cached_prefix_is_recomputed_and_still_cached(tiny):
    ids = _prompt(24, seed=1)
    scheduler = build_scheduler(tiny, kv_slots=256)
    _run(scheduler, {0: (ids[:16] + _prompt(4, seed=2), _params(None))})
    out = _run(scheduler, {1: (ids, _params())})
    assert out[1][0].cached_tokens == 0
    _assert_matches_hf(ids, _prompt_entries(out[1]))
    # Its own KV went into the cache: a plain request for the same prompt reuses all of it.
    again = _run(scheduler, {2: (ids, _params(None))})
    assert again[2][0].cached_tokens == len(ids) - 1
    assert again[2][0].prompt_logprobs is None


def test_chunked_prefill_matches_hf(tiny):
    ids = _prompt(30, seed=3)
    out = _run(build_scheduler(tiny, kv_slots=256, max_prefill_tokens=8), {0: (ids, _params())})
    _assert_matches_hf(ids, _prompt_entries(out[0]))


def test_whole_vocabulary_and_no_alternatives(tiny):
    ids = _prompt(6, seed=4)
    vocab = tiny.model.vocab_size
    for k in (0, vocab):
        out = _run(build_scheduler(tiny, kv_slots=64), {0: (ids, _params(k))})
        entries = _prompt_entries(out[0])
        _assert_matches_hf(ids, entries, k)
        if k == vocab:
            assert all(sorted(e.top_ids) == list(range(vocab)) for e in entries[1:])


def test_raw_distribution_whatever_the_sampling_settings(tiny):
    ids = _prompt(12, seed=5)
    shaped = _params(allowed_token_ids=[7, 8, 9], repetition_penalty=1.5, presence_penalty=1.0)
    shaped.temperature = 0.5
    out = _run(build_scheduler(tiny, kv_slots=64), {0: (ids, shaped)})
    _assert_matches_hf(ids, _prompt_entries(out[0]))


def test_prompt_of_one_token(tiny):
    out = _run(build_scheduler(tiny, kv_slots=64), {0: ([1234], _params())})
    assert _prompt_entries(out[0]) == [None]


def _mixed_batch() -> dict[int, tuple[list[int], SamplingParams]]:
    return {
        0: (_prompt(30, seed=6), _params()),
        1: (_prompt(9, seed=7), _params(None)),
        2: (_prompt(17, seed=8), _params(3)),
        3: (_prompt(5, seed=9), SamplingParams(temperature=1.0, seed=11, max_tokens=6,
                                               ignore_eos=True, logprobs=3)),
        4: (_prompt(40, seed=10), _params(1)),
    }


def test_batch_invariance(tiny):
    """Every request, with or without prompt logprobs, gets the bits it gets alone."""
    requests = _mixed_batch()
    together = _run(build_scheduler(tiny, kv_slots=512), requests)
    for uid, request in requests.items():
        alone = _run(build_scheduler(tiny, kv_slots=512), {uid: request})[uid]
        assert _prompt_entries(together[uid]) == _prompt_entries(alone)
        assert [(m.token_ids, m.logprobs) for m in together[uid]] == \
               [(m.token_ids, m.logprobs) for m in alone]


def test_chunks_cut_by_the_neighbours(tiny):
    """A shared prefill budget cuts each prompt where the other requests leave it."""
    requests = _mixed_batch()
    together = _run(build_scheduler(tiny, kv_slots=512, max_prefill_tokens=16), requests)
    for uid, request in requests.items():
        if request[1].prompt_logprobs is None:
            continue
        alone = _prompt_entries(_run(build_scheduler(tiny, kv_slots=512), {uid: request})[uid])
        chunked = _prompt_entries(together[uid])
        assert len(chunked) == len(alone) and chunked[0] is None
        # Measured: exactly 0, as recompute after a preemption (test_preemption_and_faults).
        for a, b in zip(chunked[1:], alone[1:]):
            assert (a.token_id, a.rank, a.top_ids) == (b.token_id, b.rank, b.top_ids)
            assert abs(a.logprob - b.logprob) <= 1e-6
            assert max(abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs)) <= 1e-6


def test_scripted_prompt_rows_follow_the_closed_form(make_scripted_model):
    alternatives = {7: 2.0, 8: 1.0}
    folder = make_scripted_model([{"trigger": None, "token_ids": [5, 6]}], base_logit=-1.0,
                                 alternatives=[list(a) for a in alternatives.items()])
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    vocab = loaded.model.vocab_size
    log_z = math.log(sum(math.exp(a) for a in alternatives.values())
                     + (vocab - len(alternatives)) * math.exp(-1.0))
    ids = [100, 7, 200, 8, 300, 7]
    out = _run(build_scheduler(loaded, kv_slots=64), {0: (ids, _params(3))})
    entries = _prompt_entries(out[0])
    assert entries[0] is None and len(entries) == len(ids)
    for token, entry in zip(ids[1:], entries[1:]):
        logit = alternatives.get(token, -1.0)
        assert entry.logprob == pytest.approx(logit - log_z, abs=1e-5)
        assert entry.rank == 1 + sum(a > logit for a in alternatives.values())
        assert entry.top_ids[:2] == [7, 8]
        assert entry.top_logprobs == pytest.approx([2.0 - log_z, 1.0 - log_z, -1.0 - log_z],
                                                   abs=1e-5)
    assert [t for m in out[0] for t in m.token_ids][:2] == [5, 6]  # sampling rows keep the script
