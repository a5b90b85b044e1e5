"""Prompt logprobs through preemption and a failed step: scored once, sent once, as alone."""

from __future__ import annotations

import random

import pytest

from freetoken.core import SamplingParams
from freetoken.message import DetokenizeMsg, UserMsg
from freetoken.models.registry import load_model
from freetoken.scheduler.factory import build_scheduler
from tests.model_fixtures import drain, tiny_random_folder


@pytest.fixture(scope="module")
def tiny():
    return load_model(tiny_random_folder("qwen3"), dtype="float32", device="cpu")


def _prompts() -> dict[int, list[int]]:
    r = random.Random(0)
    return {uid: [r.randrange(1000, 40000) for _ in range(n)]
            for uid, n in enumerate((5, 12, 20, 30, 9, 17))}


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)


def _run(scheduler, prompts: dict[int, list[int]]) -> dict[int, list[DetokenizeMsg]]:
    for uid, ids in prompts.items():
        assert scheduler.add(UserMsg(uid, ids, _params())) == []
    out: dict[int, list[DetokenizeMsg]] = {}
    while scheduler.has_work:
        for msg in scheduler.step():
            out.setdefault(msg.uid, []).append(msg)
    return out


def _alone(tiny, prompts: dict[int, list[int]]) -> dict[int, list[DetokenizeMsg]]:
    out = {}
    for uid, ids in prompts.items():
        out.update(_run(build_scheduler(tiny, kv_slots=1024), {uid: ids}))
    return out


def _assert_as_alone(out, alone, prompts) -> None:
    for uid, ids in prompts.items():
        sent = [m.prompt_logprobs for m in out[uid] if m.prompt_logprobs is not None]
        assert sent == [alone[uid][0].prompt_logprobs] and len(sent[0]) == len(ids)
        assert [m.token_ids for m in out[uid]] == [m.token_ids for m in alone[uid]]


def test_preempted_request_does_not_score_its_prompt_again(tiny):
    prompts = _prompts()
    # As test_preemption_and_faults: the prompts fit in 96 slots, their outputs do not.
    scheduler = build_scheduler(tiny, kv_slots=96)
    looked_up = []
    match = scheduler.cache.match
    scheduler.cache.match = lambda ids: (looked_up.append(list(ids)), match(ids))[1]
    out = _run(scheduler, prompts)
    assert scheduler.stats()["preemptions"] >= 3
    # Readmitted with output, a request may take a cache match again; before that, never.
    assert looked_up
    for ids in looked_up:
        assert any(ids[: len(p)] == p and len(ids) > len(p) for p in prompts.values())
    _assert_as_alone(out, _alone(tiny, prompts), prompts)


def test_failed_step_rerun_alone_scores_each_prompt_once(tiny):
    prompts = _prompts()
    scheduler = build_scheduler(tiny, kv_slots=1024, max_prefill_tokens=16)
    model, failures = scheduler.engine.model, []

    def model_failing_on_batches(batch, ctx):
        # Fails every prefill step of several requests, so each chunk runs again alone.
        if len(batch.reqs) > 1 and batch.prompt_rows:
            failures.append(len(batch.reqs))
            raise RuntimeError("boom")
        return model(batch, ctx)

    scheduler.engine.model = model_failing_on_batches
    out = _run(scheduler, prompts)
    assert failures
    _assert_as_alone(out, _alone(tiny, prompts), prompts)


def _scored_rows(scheduler) -> list[int]:
    """The scored prompt rows of each forward `scheduler` runs from now on (a list it appends to)."""
    forward, rows = scheduler.engine.forward_batch, []

    def counting(batch):
        rows.append(sum(n for _, n in batch.prompt_rows))
        return forward(batch)

    scheduler.engine.forward_batch = counting
    return rows


def test_scored_rows_per_step_are_bounded(tiny, monkeypatch):
    """Each scored prompt token is a vocabulary-wide logit row: a step makes at most
    PROMPT_LOGPROB_ROWS of them, and a long prompt is scored over several steps, exactly."""
    from freetoken.scheduler import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROB_ROWS", 8)
    prompts = {1: _prompts()[3], 2: _prompts()[2]}  # 30 and 20 tokens
    scheduler = build_scheduler(tiny, kv_slots=1024)
    rows = _scored_rows(scheduler)
    out = _run(scheduler, prompts)
    assert max(rows) == 8 and sum(rows) == 29 + 19
    _assert_as_alone(out, _alone(tiny, prompts), prompts)


def test_scoring_from_a_label_scores_its_rows_alone_and_reuses_the_cached_prompt(tiny):
    """Label scoring's requests (`prompt_logprobs_from` the label's first token): entries from
    there on only, equal to scoring the whole prompt + label; a second label after the same
    prompt takes the prompt from the prefix cache and makes no more scored rows than its
    tokens."""
    prompt = _prompts()[2]
    labels = [[3000, 3001, 3002], [3000, 4000, 4001, 4002]]
    whole = {uid: _run(build_scheduler(tiny, kv_slots=1024), {uid: prompt + label})[uid][0]
             for uid, label in enumerate(labels)}
    scheduler = build_scheduler(tiny, kv_slots=1024)
    rows = _scored_rows(scheduler)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2,
                            prompt_logprobs_from=len(prompt))
    for uid, label in enumerate(labels):
        rows.clear()
        first = drain(scheduler, {uid: (prompt + label, params)})[uid][0]
        assert first.prompt_logprobs[: len(prompt)] == [None] * len(prompt)
        assert first.prompt_logprobs[len(prompt):] == whole[uid].prompt_logprobs[len(prompt):]
        assert sum(rows) == len(label)
        assert first.cached_tokens == (0 if uid == 0 else len(prompt) - 1)
