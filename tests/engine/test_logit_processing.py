"""Logit processors (bad_words, min_tokens, logit_bias, penalties) on hand-made logits: each
against a plain reference of its rule, their order, raw logprobs, batch invariance."""

from __future__ import annotations

import math
import random

import pytest
import torch

from freetoken.core import SamplingParams
from freetoken.engine.logit_processing import LogitProcessing
from freetoken.engine.sample import Sampler
from tests.support.logit_rules import reference

_INF = math.inf


def processed(rows: list[list[float]], params: list[SamplingParams],
              histories: list[tuple[list[int], list[int]]], eos: tuple[int, ...] = ()) -> torch.Tensor:
    x = torch.tensor(rows, dtype=torch.float32)
    processing = LogitProcessing.build(params, histories, eos, x.shape[1], torch.device("cpu"))
    if processing is not None:
        processing.apply(x)
    return x


LOGITS = [0.5, 1.2, -0.7, 2.0, 0.3, -1.5, 0.9, -0.2, 1.1, 0.0, -2.5, 0.4, 1.7, -0.9, 0.6, 0.8]
PROMPT = [1, 3, 3, 5]
OUTPUT = [5, 6, 6, 6, 8]
EOS = (2,)
BAD_WORDS = [
    [7],  # a single id: always banned
    [8, 11],  # the output ends with 8: 11 banned
    [6, 8, 15],  # ends with 6, 8: 15 banned
    [5, 6, 6, 6, 8, 10],  # prefix is the whole output: 10 banned
    [6, 12],  # the output does not end with 6
    [1, 3, 13],  # 1, 3 only in the prompt, which bad words never read
    [0, 5, 6, 6, 6, 8, 14],  # longer than the output + 1: skipped
]
CASES = {  # params, the ids they change
    "repetition": (SamplingParams(repetition_penalty=1.5), {1, 3, 5, 6, 8}),
    "repetition_below_one": (SamplingParams(repetition_penalty=0.5), {1, 3, 5, 6, 8}),
    "frequency": (SamplingParams(frequency_penalty=0.7), {5, 6, 8}),
    "presence": (SamplingParams(presence_penalty=-0.4), {5, 6, 8}),
    "logit_bias": (SamplingParams(logit_bias={3: 2.5, 9: -1.0}), {3, 9}),
    "min_tokens": (SamplingParams(min_tokens=6, stop_token_ids=[4]), {2, 4}),
    "min_tokens_ignore_eos": (SamplingParams(min_tokens=6, stop_token_ids=[4], ignore_eos=True),
                              {4}),
    "bad_words": (SamplingParams(bad_words_token_ids=BAD_WORDS), {7, 10, 11, 15}),
    "all": (SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.3,
                           logit_bias={3: 1.0, 12: -0.5}, min_tokens=9, stop_token_ids=[4],
                           bad_words_token_ids=BAD_WORDS), {1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 15}),
}


@pytest.mark.parametrize("name", CASES)
def test_each_processor_follows_its_rule(name: str) -> None:
    params, changed = CASES[name]
    got = processed([LOGITS], [params], [(PROMPT, OUTPUT)], EOS)[0]
    ref = reference(torch.tensor(LOGITS), params, PROMPT, OUTPUT, EOS)
    assert {i for i in range(len(LOGITS)) if got[i] != LOGITS[i]} == changed
    assert got.tolist() == pytest.approx(ref.tolist(), rel=1e-6)


def test_min_tokens_stops_banning_once_reached() -> None:
    params = SamplingParams(min_tokens=len(OUTPUT), stop_token_ids=[4])
    assert torch.equal(processed([LOGITS], [params], [(PROMPT, OUTPUT)], EOS)[0],
                       torch.tensor(LOGITS))


def test_order_bans_then_bias_then_repetition_then_frequency_and_presence() -> None:
    rows = [[-1.0, 3.0, 2.0, 0.0]]
    params = SamplingParams(logit_bias={0: 2.0, 2: 9.0}, repetition_penalty=2.0,
                            presence_penalty=1.0, bad_words_token_ids=[[2]])
    got = processed(rows, [params], [([0], [1])])[0].tolist()
    # Penalty first would give 0 = -1 * 2 + 2 and 1 = (3 - 1) / 2; a ban first stays -inf.
    assert got == [0.5, 0.5, -_INF, 0.0]


def test_rows_without_fields_are_untouched_and_build_nothing() -> None:
    plain = [SamplingParams(), SamplingParams(temperature=0.0, logprobs=2)]
    assert LogitProcessing.build(plain, None, EOS, 16, torch.device("cpu")) is None
    # A penalised row with nothing in its history yet has nothing to penalise.
    first_step = [SamplingParams(presence_penalty=1.0)]
    assert LogitProcessing.build(first_step, [([3], [])], EOS, 16, torch.device("cpu")) is None
    rows = [LOGITS, LOGITS[::-1], LOGITS]
    params = [SamplingParams(), CASES["all"][0], SamplingParams(temperature=0.5)]
    got = processed(rows, params, [(PROMPT, OUTPUT)] * 3, EOS)
    assert torch.equal(got[0], torch.tensor(LOGITS)) and torch.equal(got[2], torch.tensor(LOGITS))
    assert not torch.equal(got[1], torch.tensor(LOGITS[::-1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logprobs", [None, 5])
def test_greedy_takes_processed_argmax_logprobs_stay_raw(dtype: torch.dtype,
                                                         logprobs: int | None) -> None:
    sampler = Sampler(len(LOGITS), eos_token_ids=EOS)
    logits = torch.tensor([LOGITS], dtype=dtype)
    before = logits.clone()
    plain = SamplingParams(temperature=0.0, logprobs=logprobs)
    biased = SamplingParams(temperature=0.0, logprobs=logprobs, logit_bias={12: 1.0},
                            repetition_penalty=1.5)
    out = {}
    for name, p in (("plain", plain), ("biased", biased)):
        args = sampler.prepare([p], [torch.Generator()], [(PROMPT, OUTPUT)])
        out[name] = sampler.sample(logits, args)
    assert torch.equal(logits, before)
    ref = reference(logits[0].float(), biased, PROMPT, OUTPUT)
    assert out["plain"].token_ids == [3] and out["biased"].token_ids == [int(ref.argmax())] == [12]
    if logprobs is None:
        assert out["biased"].logprobs == [None]
        return
    [raw], [lp] = out["plain"].logprobs, out["biased"].logprobs
    assert raw is not None and lp is not None
    assert (lp.top_ids, lp.top_logprobs) == (raw.top_ids, raw.top_logprobs)
    raw_12 = torch.log_softmax(logits[0].float(), -1)[12].item()
    assert lp.logprob == pytest.approx(raw_12, abs=1e-6) and lp.rank == 2


def test_random_rows_sample_from_processed_logits() -> None:
    n = 300
    probs = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]
    logits = [[math.log(p) for p in probs]] * n
    params = [SamplingParams(bad_words_token_ids=[[0], [2, 1]], logit_bias={6: -100.0})] * n
    sampler = Sampler(len(probs))
    args = sampler.prepare(params, [torch.Generator().manual_seed(s) for s in range(n)],
                           [([1], [3, 2])] * n)
    assert set(sampler.sample(torch.tensor(logits), args).token_ids) == {2, 3, 4, 5}


def _mixed_batch(v: int) -> tuple[list[SamplingParams], list[tuple[list[int], list[int]]]]:
    r = random.Random(0)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(logprobs=2, repetition_penalty=1.2, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, presence_penalty=0.8, bad_words_token_ids=[[5], [9, 7]]),
        SamplingParams(top_k=20, top_p=0.9, logit_bias={1: 3.0, 4: -2.0}, min_tokens=50,
                       stop_token_ids=[11]),
        SamplingParams(),
        SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 3, 11], logprobs=1,
                       repetition_penalty=0.7, logit_bias={2: 0.5}),
    ]
    histories = [([r.randrange(v) for _ in range(r.randrange(1, 30))],
                  [r.randrange(v) for _ in range(r.randrange(0, 40))]) for _ in params]
    return params, histories


def test_row_results_do_not_depend_on_the_batch() -> None:
    v = 300
    params, histories = _mixed_batch(v)
    logits = torch.randn(len(params), v, generator=torch.Generator().manual_seed(0)) * 2
    sampler = Sampler(v, eos_token_ids=(0,))

    def run(rows: list[int]) -> dict[int, tuple]:
        args = sampler.prepare([params[i] for i in rows],
                               [torch.Generator().manual_seed(100 + i) for i in rows],
                               [histories[i] for i in rows])
        out = sampler.sample(logits[rows], args)
        return {i: (t, lp) for i, t, lp in zip(rows, out.token_ids, out.logprobs)}

    together = run(list(range(len(params))))
    assert together == run(list(reversed(range(len(params)))))
    for i in range(len(params)):
        assert run([i]) == {i: together[i]}
