"""A hybrid model (qwen3_5_text) under the scheduler: batch invariance, chunked prefill, the
snapshot prefix cache and the recurrent-state pool's accounting."""

from __future__ import annotations

import pytest

from freetoken.core import SamplingParams
from freetoken.message import UserMsg
from freetoken.scheduler.factory import build_scheduler
from freetoken.scheduler.states import RecurrentStates
from tests.model_fixtures import drain, loaded_fp32

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


@pytest.fixture(scope="module")
def loaded(tiny_hybrid_path):
    return loaded_fp32(tiny_hybrid_path("qwen3_5_text"))


def _ids(loaded, n: int, seed: int) -> list[int]:
    """A prompt of exactly n tokens."""
    text = " ".join(WORDS[(seed + 3 * i) % len(WORDS)] for i in range(n))
    return loaded.tokenizer.encode(text)[:n]


def _greedy(n=8):
    return SamplingParams(temperature=0, max_tokens=n, logprobs=2, ignore_eos=True)


def _tokens(msgs):
    return [(m.token_ids[0], m.logprobs[0]) for m in msgs]


def _assert_identical(got, expected):
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert a.logprob == b.logprob and a.top_logprobs == b.top_logprobs


def _all_free(scheduler) -> bool:
    stats = scheduler.stats()
    return stats["state_slots_free"] == stats["state_slots_total"] - stats["state_snapshots"]


@pytest.mark.parametrize("variant", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_batched_equals_alone_bit_for_bit(variant, tiny_hybrid_path):
    loaded = loaded_fp32(tiny_hybrid_path(variant))
    # Lengths across chunk boundaries (64, 128): some prefill several chunks, some a part of one.
    prompts = {uid: (_ids(loaded, n, uid), _greedy(4)) for uid, n in
               enumerate([5, 17, 63, 64, 65, 100, 129, 150])}
    alone = {}
    for uid, request in prompts.items():
        alone.update(drain(build_scheduler(loaded, kv_slots=1024, prefix_cache=False), {uid: request}))
    scheduler = build_scheduler(loaded, kv_slots=1024, prefix_cache=False)
    together = drain(scheduler, prompts)
    for uid in prompts:
        _assert_identical(_tokens(together[uid]), _tokens(alone[uid]))
    assert _all_free(scheduler) and scheduler.stats()["state_snapshots"] == 0


@pytest.mark.parametrize("budget", [64, 48, 100])
def test_chunked_prefill_equals_one_shot(loaded, budget):
    # Cuts land on the delta rule's boundaries whatever the budget: 48 takes [0, 64) (past the
    # budget), 100 takes [0, 64) then [64, 128).
    request = {0: (_ids(loaded, 150, 1), _greedy(6))}
    expected = _tokens(drain(build_scheduler(loaded, kv_slots=1024, prefix_cache=False), request)[0])
    chunked = build_scheduler(loaded, kv_slots=1024, prefix_cache=False, max_prefill_tokens=budget)
    _assert_identical(_tokens(drain(chunked, request)[0]), expected)


def test_prefix_cache_hit_equals_cold_and_resumes_from_a_snapshot(loaded):
    prefix = _ids(loaded, 140, 2)
    first, second = prefix + _ids(loaded, 20, 5), prefix + _ids(loaded, 30, 7)
    cold = _tokens(drain(build_scheduler(loaded, kv_slots=1024, prefix_cache=False),
                         {1: (second, _greedy())})[1])
    scheduler = build_scheduler(loaded, kv_slots=1024)
    drain(scheduler, {0: (first, _greedy())})
    assert scheduler.stats()["state_snapshots"] == 2  # at 64 and 128
    msgs = drain(scheduler, {1: (second, _greedy())})[1]
    assert msgs[0].cached_tokens == 128  # the deepest snapshot in the shared 140 tokens
    _assert_identical(_tokens(msgs), cold)
    assert _all_free(scheduler)


def test_state_slots_come_back_after_abort_preemption_and_eviction(loaded):
    # A pool of 160 KV slots and 2 snapshots for four 70-token prompts: requests are preempted,
    # snapshots evicted with their KV or for other snapshots.
    scheduler = build_scheduler(loaded, kv_slots=160, state_snapshots=2, max_running_requests=4)
    total = scheduler.stats()["state_slots_total"]
    assert total == 6 and scheduler.stats()["state_bytes_per_slot"] > 0
    for uid in range(4):
        assert scheduler.add(UserMsg(uid, _ids(loaded, 70, uid), _greedy(12))) == []
    scheduler.step()
    assert scheduler.stats()["state_slots_free"] < total
    scheduler.abort(3)
    out = drain(scheduler)
    assert {uid for uid, msgs in out.items() if msgs[-1].finished} == {0, 1, 2}
    assert scheduler.stats()["preemptions"] > 0
    assert scheduler.stats()["state_snapshots"] <= 2 and _all_free(scheduler)


@pytest.mark.parametrize("done,size,left,expected", [
    (0, 150, 150, 150),  # the whole rest: no cut
    (0, 100, 150, 64),  # the last boundary the budget reaches
    (0, 48, 150, 64),  # none reached: the next one, past the budget
    (64, 48, 86, 64),
    (64, 20, 30, 30),  # the prompt ends before the next boundary
    (0, 130, 150, 128),
])
def test_prefill_chunks_end_on_delta_rule_boundaries(done, size, left, expected):
    assert RecurrentStates.chunk_size(None, done, size, left) == expected
