"""Preemption by recompute, admission without reserving max_tokens, per-request fault isolation.

On a tiny random model in float32, where a step is fast and a row's bits do not depend on its
batch, so every run is compared with requests run alone.
"""

from __future__ import annotations

import logging
import random

import pytest

from freetoken.core import SamplingParams
from freetoken.scheduler.factory import build_scheduler
from freetoken.message import DetokenizeMsg, UserMsg
from freetoken.models.registry import load_model
from tests.model_fixtures import drain, tiny_random_folder

SEEDED = {1, 4}  # these sample at temperature 1 from a seed; the others are greedy


@pytest.fixture(scope="module")
def tiny():
    return load_model(tiny_random_folder("qwen3"), dtype="float32", device="cpu")


def _prompts() -> list[list[int]]:
    r = random.Random(0)
    return [[r.randrange(1000, 40000) for _ in range(n)] for n in (5, 12, 20, 30, 9, 17)]


def _params(uid: int, max_tokens: int | None = 24) -> SamplingParams:
    if uid in SEEDED:
        return SamplingParams(temperature=1.0, seed=1000 + uid, max_tokens=max_tokens,
                              ignore_eos=True, logprobs=2)
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def _run(scheduler, requests: dict[int, list[int]]) -> dict[int, list[DetokenizeMsg]]:
    return drain(scheduler, {uid: (ids, _params(uid)) for uid, ids in requests.items()})


def _tokens(msgs: list[DetokenizeMsg]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def _max_logprob_diff(a: list[DetokenizeMsg], b: list[DetokenizeMsg]) -> float:
    pairs = zip([lp for m in a for lp in m.logprobs], [lp for m in b for lp in m.logprobs])
    return max(max(abs(x.logprob - y.logprob),
                   *(abs(p - q) for p, q in zip(x.top_logprobs, y.top_logprobs)))
               for x, y in pairs)


def _alone(tiny, prompts: dict[int, list[int]], **kw) -> dict[int, list[DetokenizeMsg]]:
    out = {}
    for uid, ids in prompts.items():
        out.update(_run(build_scheduler(tiny, kv_slots=1024, **kw), {uid: ids}))
    return out


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_preempted_requests_equal_each_alone(tiny, prefix_cache):
    prompts = dict(enumerate(_prompts()))
    alone = _alone(tiny, prompts, prefix_cache=prefix_cache)
    # 96 slots hold the prompts (93 tokens) but not the 144 outputs: some requests queue, and
    # the newest running ones are preempted as the outputs grow.
    scheduler = build_scheduler(tiny, kv_slots=96, prefix_cache=prefix_cache)
    preempted = []
    preempt = scheduler._preempt
    scheduler._preempt = lambda r: (preempted.append((r.uid, len(r.output_ids))), preempt(r))
    together = _run(scheduler, prompts)
    assert scheduler.stats()["preemptions"] == len(preempted) >= 3
    assert SEEDED & {uid for uid, _ in preempted}  # a seeded stream resumed after a preemption
    assert max(n for _, n in preempted) >= 2  # outputs were recomputed, not only prompts
    for uid, ids in prompts.items():
        assert _tokens(together[uid]) == _tokens(alone[uid])
        # Recomputed without a word to the client: the first message's counts came once.
        assert [m.prompt_tokens for m in together[uid] if m.prompt_tokens] == [len(ids)]
        assert together[uid][-1].finish_reason == "length"
    # Measured: exactly 0 (recompute and batching keep every bit on this CPU).
    assert max(_max_logprob_diff(together[uid], alone[uid]) for uid in prompts) <= 1e-6
    if prefix_cache:
        scheduler.cache.evict(scheduler.engine.kv.num_slots)
    assert scheduler.engine.kv.num_free == 96


def test_small_request_runs_beside_long_ones(tiny):
    prompts = _prompts()
    scheduler = build_scheduler(tiny, kv_slots=1024, prefix_cache=False)
    long = SamplingParams(temperature=0, max_tokens=450, ignore_eos=True)
    for uid in range(3):  # reserving prompt + max_tokens, only two of these would fit
        scheduler.add(UserMsg(uid, prompts[uid], long))
    scheduler.step()
    scheduler.add(UserMsg(9, prompts[4], SamplingParams(temperature=0, max_tokens=3)))
    msgs = [m for _ in range(4) for m in scheduler.step() if m.uid == 9]
    assert len(_tokens(msgs)) == 3 and msgs[-1].finish_reason == "length"
    assert [r.uid for r in scheduler.running] == [0, 1, 2] and not scheduler.waiting
    for uid in range(3):
        scheduler.abort(uid)
    assert scheduler.engine.kv.num_free == 1024


def test_request_without_max_tokens_holds_only_its_tokens(tiny):
    a, b = _prompts()[:2]
    scheduler = build_scheduler(tiny, kv_slots=300, prefix_cache=False)
    for uid, ids in enumerate((a, b)):
        scheduler.add(UserMsg(uid, ids, _params(uid, max_tokens=None)))
    for step in range(1, 6):
        scheduler.step()
        assert len(scheduler.running) == 2
        # The prompts, and every sampled token but the last (its KV comes with the next step).
        assert scheduler.engine.kv.num_free == 300 - len(a) - len(b) - 2 * (step - 1)
    assert [r.params.max_tokens for r in scheduler.running] == [300 - len(a), 300 - len(b)]


@pytest.mark.parametrize("where", ["model", "sampler"])
def test_failing_request_fails_alone(tiny, where, caplog):
    """The faulty request (seeded, so that it is a random row) breaks its steps once it has three
    tokens: in the model's forward, or after the sampler drew every row's noise."""
    prompts = dict(enumerate(_prompts()[:5]))
    bad_uid = 4
    scheduler = build_scheduler(tiny, kv_slots=1024, prefix_cache=False)
    engine = scheduler.engine
    for uid, ids in prompts.items():
        scheduler.add(UserMsg(uid, ids, _params(uid)))
    bad = next(r for r in scheduler.waiting if r.uid == bad_uid)
    model, sample = engine.model, engine.sampler.sample

    def faulty_model(batch, ctx):
        if where == "model" and len(bad.output_ids) >= 3 and any(r is bad for r in batch.reqs):
            raise RuntimeError("boom")
        return model(batch, ctx)

    def faulty_sample(logits, args):
        out = sample(logits, args)
        if where == "sampler" and len(bad.output_ids) >= 3 and any(
            g is bad.generator for g in args.rand_generators
        ):
            raise RuntimeError("boom")
        return out

    engine.model, engine.sampler.sample = faulty_model, faulty_sample
    out: dict[int, list[DetokenizeMsg]] = {}
    with caplog.at_level(logging.ERROR, logger="freetoken"):
        while scheduler.has_work:
            for msg in scheduler.step():
                out.setdefault(msg.uid, []).append(msg)
    failed = out.pop(bad_uid)
    assert len(_tokens(failed)) == 3
    assert failed[-1].finished and failed[-1].finish_reason == "error"
    assert failed[-1].error_code == "engine_error" and "boom" in failed[-1].error
    assert any(r.exc_info and "boom" in str(r.exc_info[1]) for r in caplog.records)

    expected = _run(build_scheduler(tiny, kv_slots=1024, prefix_cache=False),
                    {uid: ids for uid, ids in prompts.items() if uid != bad_uid})
    for uid in expected:  # the seeded uid 1 included: a re-run does not shift its stream
        assert _tokens(out[uid]) == _tokens(expected[uid])
        assert _max_logprob_diff(out[uid], expected[uid]) <= 1e-6
    assert engine.kv.num_free == 1024
    # The engine serves on.
    assert _tokens(_run(scheduler, {7: prompts[0]})[7]) == _tokens(expected[0])


def test_request_failing_alone_fails_once(tiny, caplog):
    scheduler = build_scheduler(tiny, kv_slots=256, prefix_cache=False)
    model, calls = scheduler.engine.model, []

    def faulty_model(batch, ctx):
        calls.append([r.uid for r in batch.reqs])
        if calls[-1] == [0]:
            raise ValueError("bad shape")
        return model(batch, ctx)

    scheduler.engine.model = faulty_model
    scheduler.add(UserMsg(0, _prompts()[0], _params(0)))
    with caplog.at_level(logging.ERROR, logger="freetoken"):
        [msg] = scheduler.step()
    assert calls == [[0]]  # alone already: no retry
    assert (msg.uid, msg.finish_reason, msg.error_code) == (0, "error", "engine_error")
    assert "bad shape" in msg.error and caplog.records
    assert not scheduler.has_work and scheduler.engine.kv.num_free == 256
    assert len(_tokens(_run(scheduler, {1: _prompts()[1]})[1])) == 24


@pytest.mark.parametrize("ids, params, field", [
    ([5, 6], SamplingParams(seed=2**64), "seed"),
    ([5, 6], SamplingParams(seed=-1), "seed"),
    ([5, 6], SamplingParams(seed=2**63), "seed"),
    ([5, 49152], SamplingParams(), "prompt"),
    ([], SamplingParams(), "prompt"),
    ([5, 6], SamplingParams(allowed_token_ids=[3, -1]), "allowed_token_ids"),
    ([5, 6], SamplingParams(logit_bias={49152: 1.0}), "logit_bias"),
    ([5, 6], SamplingParams(bad_words_token_ids=[[5, 60000]]), "bad_words"),
    ([5, 6], SamplingParams(bad_words_token_ids=[[5], []]), "bad_words"),
    ([5, 6], SamplingParams(stop_token_ids=[49152]), "stop_token_ids"),
])
def test_invalid_request_is_refused_alone(tiny, ids, params, field):
    scheduler = build_scheduler(tiny, kv_slots=256)
    largest_seed = SamplingParams(temperature=1.0, seed=2**63 - 1, max_tokens=4)
    assert scheduler.add(UserMsg(0, _prompts()[0], largest_seed)) == []
    [msg] = scheduler.add(UserMsg(1, ids, params))
    assert (msg.finished, msg.finish_reason, msg.error_code) == (True, "error", "invalid_request")
    assert field in msg.error
    out = []
    while scheduler.has_work:
        out += scheduler.step()
    assert {m.uid for m in out} == {0} and sum(len(m.token_ids) for m in out) == 4
