"""Prefix cache: hits equal misses, eviction keeps every request correct, references drop."""

from __future__ import annotations

import pytest

from freetoken.core import SamplingParams
from freetoken.scheduler.factory import build_scheduler
from freetoken.message import UserMsg
from tests.model_fixtures import default_model

pytestmark = pytest.mark.slow  # the default model

PREFIX = ("You are a careful classifier. Read the statement and answer with one word, "
          "Yes or No, and nothing else. ") * 3


def _params():
    return SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)


def _run(scheduler, prompts, first_uid=0):
    tok = default_model().tokenizer
    for i, prompt in enumerate(prompts):
        scheduler.add(UserMsg(first_uid + i, tok.encode(prompt), _params()))
    out, cached = {}, {}
    while scheduler.has_work:
        for msg in scheduler.step():
            out.setdefault(msg.uid, []).extend(zip(msg.token_ids, msg.logprobs))
            if msg.prompt_tokens:
                cached[msg.uid] = msg.cached_tokens
    return out, cached


def _same(a, b):
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert abs(x.logprob - y.logprob) <= 1e-5
        assert max(abs(p - q) for p, q in zip(x.top_logprobs, y.top_logprobs)) <= 1e-5


def test_hit_equals_miss_and_reports_cached_tokens():
    prompts = [PREFIX + f"Statement {i}: the sky is green." for i in range(3)]
    cold = build_scheduler(default_model(), kv_slots=4096, prefix_cache=False)
    miss, _ = _run(cold, prompts)
    warm = build_scheduler(default_model(), kv_slots=4096)
    _run(warm, prompts[:1], first_uid=100)
    queried, found = warm.prefix_queries, warm.prefix_hits
    hit, cached = _run(warm, prompts)
    n_prefix = len(default_model().tokenizer.encode(PREFIX))
    assert all(c >= n_prefix - 1 for c in cached.values())
    # The counters /metrics reads: every admitted prompt token looked up, the cached ones found.
    stats = warm.stats()
    assert stats["prefix_cache_hits"] - found == sum(cached.values())
    assert stats["prefix_cache_queries"] - queried == sum(
        len(default_model().tokenizer.encode(p)) for p in prompts)
    assert stats["kv_used"] == 0  # what the cache alone holds counts as free in the usage
    for uid in miss:
        _same(hit[uid], miss[uid])


def test_eviction_under_a_small_pool_keeps_results_correct():
    prompts = [PREFIX + f"Statement {i}." for i in range(6)] + [f"Other {i}." for i in range(4)]
    reference, _ = _run(build_scheduler(default_model(), kv_slots=4096, prefix_cache=False), prompts)
    small = build_scheduler(default_model(), kv_slots=160)
    out, _ = _run(small, prompts)
    for uid in reference:
        _same(out[uid], reference[uid])
    kv = small.engine.kv
    # Every slot still taken is held by the cache alone, and can be evicted back to the pool.
    small.cache.evict(kv.num_slots)
    assert kv.num_free == kv.num_slots


def test_abort_releases_the_requests_references():
    scheduler = build_scheduler(default_model(), kv_slots=1024)
    tok = default_model().tokenizer
    _run(scheduler, [PREFIX + "first."])
    # Greedy and past EOS: sampled at temperature 1 it could end by itself within the two steps
    # (it did once, in a fresh-clone run), releasing its slots before the abort.
    scheduler.add(UserMsg(7, tok.encode(PREFIX + "second."),
                          SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)))
    scheduler.step()
    scheduler.step()
    assert scheduler.engine.kv.num_used > len(tok.encode(PREFIX))  # shared slots included
    scheduler.abort(7)
    assert scheduler.engine.kv.num_used == 0
    scheduler.cache.evict(scheduler.engine.kv.num_slots)
    assert scheduler.engine.kv.num_free == scheduler.engine.kv.num_slots
