"""Sampler tests on fake logits: support sets, exact greedy, seeding, logprobs, masks, op order."""

from __future__ import annotations

import math
import random

import pytest
import torch

from freetoken.core import SamplingParams
from freetoken.engine import sample as sample_mod
from freetoken.engine.sample import SampleOutput, Sampler

# probs 0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02: support boundaries sit far from float noise.
PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]
LOGITS = [math.log(p) for p in PROBS]


def run(rows: list[list[float]], params: list[SamplingParams], seeds: list[int] | None = None,
        dtype: torch.dtype = torch.float32) -> SampleOutput:
    seeds = seeds if seeds is not None else list(range(len(params)))
    sampler = Sampler(len(rows[0]))
    args = sampler.prepare(params, [torch.Generator().manual_seed(s) for s in seeds])
    return sampler.sample(torch.tensor(rows, dtype=dtype), args)


def draws(logits: list[float], p: SamplingParams, n: int = 400) -> set[int]:
    """Tokens drawn by n rows with identical logits and params, each with its own seed."""
    return set(run([logits] * n, [p] * n).token_ids)


def log_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    lse = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - lse for x in xs]


def rand_logits(v: int, seed: int) -> list[float]:
    r = random.Random(seed)
    return [r.gauss(0.0, 2.0) for _ in range(v)]


def test_greedy_exact_in_mixed_batch() -> None:
    # A 1e-6 near-tie: a 1e-6-temperature trick plus random noise would flip some of these.
    rows = [[x / 8 for x in rand_logits(1000, i)] for i in range(6)]
    for r in rows:
        r[17], r[18] = 1.0 + 1e-6, 1.0  # both above the rest (|x|/8 < 1 w.h.p.)
    assert all(max(r[:17] + r[19:]) < 1.0 for r in rows)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=0.0, allowed_token_ids=[5, 900]), SamplingParams()]
    for seed in range(30):
        out = run(rows, params, seeds=[seed * 6 + i for i in range(6)]).token_ids
        assert out[0] == out[2] == 17
        assert out[4] == (5 if rows[4][5] > rows[4][900] else 900)
    # All-greedy fast path agrees with torch argmax.
    out = run(rows, [SamplingParams(temperature=0.0)] * 6).token_ids
    assert out == torch.tensor(rows).argmax(-1).tolist()


def test_argmax_keeps_torch_rules_on_ties_infinities_and_nan() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (64, 300), generator=g).float()  # many tied maxima
    r = torch.rand(64, 300, generator=g)
    x[r < 0.2] = float("-inf")
    x[:8][r[:8] > 0.97] = float("inf")
    x[8:16][r[8:16] > 0.97] = float("nan")
    x[16] = float("-inf")
    x[17] = torch.where(r[17] < 0.5, -0.0, 0.0)
    assert torch.equal(sample_mod.argmax(x), torch.argmax(x, dim=-1))
    assert torch.equal(sample_mod.argmax(x[:, ::3]), torch.argmax(x[:, ::3], dim=-1))


@pytest.mark.parametrize("p, support", [
    (SamplingParams(), {0, 1, 2, 3, 4, 5, 6}),
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_p=0.75), {0, 1, 2}),  # mass before token 2 is 0.65 < 0.75, before 3 is 0.8
    (SamplingParams(top_p=0.66), {0, 1, 2}),
    (SamplingParams(top_p=0.64), {0, 1}),
    (SamplingParams(top_p=1e-9), {0}),
    (SamplingParams(top_p=0.0), {0}),  # the top token always survives
    (SamplingParams(min_p=0.2), {0, 1, 2, 3}),  # threshold 0.08
    (SamplingParams(min_p=0.3), {0, 1, 2}),  # threshold 0.12
    (SamplingParams(min_p=0.4), {0, 1}),
    # temperature first: at T=2, p ~ sqrt(PROBS), ratios to max 1, .79, .61, .5, .35 -> {0..3}
    (SamplingParams(temperature=2.0, min_p=0.4), {0, 1, 2, 3}),
    # top-k then top-p on the renormalised top-2 (.615, .385): only token 0 reaches 0.6.
    (SamplingParams(top_k=2, top_p=0.6), {0}),
    (SamplingParams(top_k=4, top_p=0.75), {0, 1, 2}),
    (SamplingParams(min_p=0.3, top_k=5, top_p=0.99), {0, 1, 2}),
])
@pytest.mark.parametrize("candidates", [1024, 3, 1])  # small: the top-p cut lies past them
def test_support_sets(p: SamplingParams, support: set[int], candidates: int,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sample_mod, "TOP_P_CANDIDATES", candidates)
    assert draws(LOGITS, p) == support


def test_top_p_zero_keeps_top_token() -> None:
    # Reversed so the top token is the last id: an all -inf (nan) row would argmax to id 0.
    assert draws(LOGITS[::-1], SamplingParams(top_p=0.0), n=50) == {6}


@pytest.mark.parametrize("candidates", [1024, 1])
def test_support_sets_mixed_batch(candidates: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sample_mod, "TOP_P_CANDIDATES", candidates)
    # Different features per row in one batch: each row's tensors line up with its own row.
    ps = [SamplingParams(top_k=2), SamplingParams(top_p=0.64), SamplingParams(min_p=0.3),
          SamplingParams(temperature=0.0), SamplingParams(temperature=0.5)]
    supports = [{0, 1}, {0, 1}, {0, 1, 2}, {0}, set(range(7))]
    seen: list[set[int]] = [set() for _ in ps]
    for step in range(300):
        out = run([LOGITS] * len(ps), ps, seeds=[step * 10 + i for i in range(len(ps))])
        for s, t in zip(seen, out.token_ids):
            s.add(t)
    assert seen[:4] == supports[:4]
    assert seen[4] <= supports[4] and {0, 1, 2} <= seen[4]


def test_top_k_neighbour_does_not_cut_plain_row() -> None:
    # The top_k=2 row sizes the candidate topk at 2; the plain row must still see all 7 tokens.
    seen: list[set[int]] = [set(), set()]
    for seed in range(300):
        out = run([LOGITS, LOGITS], [SamplingParams(top_k=2), SamplingParams()], [seed, seed + 1])
        for s, t in zip(seen, out.token_ids):
            s.add(t)
    assert seen == [{0, 1}, set(range(7))]


def test_draw_frequencies_follow_probs() -> None:
    # Support checks cannot see a wrong race (e.g. argmax(p / U) instead of p / Exp(1)).
    n = 4000
    counts = [0] * len(PROBS)
    for t in run([LOGITS] * n, [SamplingParams()] * n).token_ids:
        counts[t] += 1
    assert [c / n for c in counts] == pytest.approx(PROBS, abs=0.03)  # ~4 standard errors


def test_seeded_reproducible_independent_of_batch() -> None:
    v = 64
    target, p = rand_logits(v, 1), SamplingParams(temperature=1.3, top_p=0.95, seed=123)
    others = [rand_logits(v, 2), rand_logits(v, 3), rand_logits(v, 4)]
    other_ps = [SamplingParams(temperature=0.0), SamplingParams(top_k=5),
                SamplingParams(allowed_token_ids=[1, 2, 3], logprobs=2)]
    layouts = [
        ([target], [p], [123], 0),
        ([others[0], target], [other_ps[0], p], [7, 123], 1),
        ([others[1], others[2], target, others[0]],
         [other_ps[1], other_ps[2], p, other_ps[0]], [8, 9, 123, 10], 2),
    ]
    seqs = []
    for rows, ps, seeds, pos in layouts:
        sampler = Sampler(v)
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        args = sampler.prepare(ps, gens)
        logits = torch.tensor(rows)
        seqs.append([sampler.sample(logits, args).token_ids[pos] for _ in range(30)])
    assert seqs[0] == seqs[1] == seqs[2]
    assert len(set(seqs[0])) > 3  # really random, not stuck on one token
    sampler = Sampler(v)
    args = sampler.prepare([p], [torch.Generator().manual_seed(124)])
    assert [sampler.sample(torch.tensor([target]), args).token_ids[0] for _ in range(30)] != seqs[0]


def test_logprobs_match_hand_log_softmax_and_ignore_temperature() -> None:
    logits = rand_logits(50, 5)
    ref = log_softmax(logits)
    order = sorted(range(50), key=lambda i: -ref[i])
    ps = [SamplingParams(temperature=0.0, logprobs=4), SamplingParams(temperature=0.3, logprobs=4),
          SamplingParams(temperature=5.0, top_k=20, min_p=0.01, top_p=0.9, logprobs=4)]
    ranks_seen = set()
    for seed in range(40):
        out = run([logits] * 3, ps, seeds=[seed, seed + 100, seed + 200])
        for tok, lp in zip(out.token_ids, out.logprobs):
            assert lp is not None and lp.token_id == tok
            assert lp.logprob == pytest.approx(ref[tok], abs=1e-5)
            assert lp.rank == 1 + sum(r > ref[tok] for r in ref)
            assert lp.top_ids == order[:4]  # not affected by temperature/top-k/top-p/min_p
            assert lp.top_logprobs == pytest.approx([ref[i] for i in order[:4]], abs=1e-5)
            ranks_seen.add(lp.rank)
    assert len(ranks_seen) > 2  # the hot row really produced non-top tokens


def test_zero_k_and_none_logprobs() -> None:
    ps = [SamplingParams(logprobs=0), SamplingParams(), SamplingParams(temperature=0, logprobs=0)]
    out = run([LOGITS] * 3, ps)
    lp0, none, lp2 = out.logprobs
    assert none is None
    assert lp0 is not None and lp0.top_ids == [] and lp0.top_logprobs == []
    assert lp2 is not None and lp2.top_ids == [] and lp2.rank == 1 and lp2.token_id == 0
    assert lp2.logprob == pytest.approx(math.log(0.4), abs=1e-5)
    assert run([LOGITS], [SamplingParams()]).logprobs == [None]
    # K above V is clamped, and -1 (vLLM's "whole vocabulary") gives every id.
    for k in (50, -1):
        full = run([LOGITS], [SamplingParams(logprobs=k)]).logprobs[0]
        assert full is not None and full.top_ids == list(range(7))


def test_masked_rows_sample_allowed_and_renormalise() -> None:
    v, allowed = 20, [3, 7, 7, 11]  # duplicate id on purpose
    logits = rand_logits(v, 6)
    logits[0], logits[1] = 10.0, 9.0  # the unmasked best tokens are banned
    a = set(allowed)
    best = sorted(a, key=lambda i: -logits[i])
    for p in [SamplingParams(allowed_token_ids=allowed),
              SamplingParams(temperature=3.0, top_p=0.99, allowed_token_ids=allowed)]:
        assert draws(logits, p) == a
    # Mask before top-k: top_k=2 keeps the best two ALLOWED ids, top_k=1 picks the best allowed.
    assert draws(logits, SamplingParams(temperature=5.0, top_k=2, allowed_token_ids=allowed)) \
        == set(best[:2])
    assert draws(logits, SamplingParams(top_k=1, allowed_token_ids=allowed), n=20) == {best[0]}

    lse = math.log(sum(math.exp(logits[i]) for i in a))
    ps = [SamplingParams(logprobs=5, allowed_token_ids=allowed), SamplingParams(logprobs=2)]
    raw = log_softmax(logits)
    for seed in range(10):
        masked, plain = run([logits, logits], ps, seeds=[seed, seed + 50]).logprobs
        assert masked is not None and plain is not None
        assert masked.top_ids == best  # 3 allowed ids < K=5, no -inf entries
        assert masked.top_logprobs == pytest.approx([logits[i] - lse for i in best], abs=1e-5)
        assert sum(math.exp(x) for x in masked.top_logprobs) == pytest.approx(1.0, abs=1e-5)
        assert masked.logprob == pytest.approx(logits[masked.token_id] - lse, abs=1e-5)
        assert masked.rank == 1 + best.index(masked.token_id)
        # The unmasked neighbour keeps raw, full-vocabulary logprobs.
        assert plain.top_ids == [0, 1]
        assert plain.top_logprobs == pytest.approx(raw[:2], abs=1e-5)
        assert plain.logprob == pytest.approx(raw[plain.token_id], abs=1e-5)


def test_masked_row_logprobs_do_not_depend_on_the_batch() -> None:
    """A row with allowed ids is renormalised over its own ids whatever its neighbours allow
    (other id sets, none, listed ids) and however many rows share its ids: the same bits."""
    v = 50_000  # a real vocabulary's width: most of each masked row is -inf
    ids5 = [40_001, 7, 12_345, 999, 3]
    target = SamplingParams(temperature=0.0, logprobs=4, allowed_token_ids=ids5)
    neighbours = [SamplingParams(temperature=0.0, logprobs=2, allowed_token_ids=[10, 20, 30]),
                  SamplingParams(temperature=0.0, logprobs=3),
                  SamplingParams(temperature=0.7, logprobs=2, allowed_token_ids=ids5),
                  SamplingParams(temperature=0.0, logprob_token_ids=[7, 8], allowed_token_ids=ids5)]
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(v, generator=gen) * 4
    others = torch.randn(len(neighbours), v, generator=gen) * 4

    def entry(rows: torch.Tensor, params: list[SamplingParams], at: int):
        sampler = Sampler(v)
        args = sampler.prepare(params, [torch.Generator().manual_seed(i) for i in range(len(params))])
        return sampler.sample(rows, args).logprobs[at]

    alone = entry(row[None], [target], 0)
    lse = torch.logsumexp(row[ids5].double(), 0)
    best = sorted(ids5, key=lambda i: -row[i])
    assert alone.token_id == best[0] and alone.top_ids == best[:4]
    assert alone.top_logprobs == pytest.approx([float(row[i] - lse) for i in best[:4]], abs=1e-5)
    for k in range(len(neighbours) + 1):
        rows = torch.cat([others[:k], row[None], others[k:]])
        params = neighbours[:k] + [target] + neighbours[k:]
        assert entry(rows, params, k) == alone, k


def test_the_heads_label_columns_give_the_whole_rows_bits() -> None:
    """Logits of the allowed ids' columns alone (what the LM head computes for a step of scoring
    rows, engine.MAX_LOGIT_COLUMNS) sample as the whole rows with -inf elsewhere: the same tokens
    and entries, bit for bit, for rows of other id sets, listed ids (a reranker's), tied labels
    and a row whose allowed logits are all -inf; with a random row they are widened first."""
    v = 50_000
    no_yes, three = [9_000, 41_000], [7, 12_345, 40_001]
    greedy = [SamplingParams(temperature=0.0, logprobs=0, allowed_token_ids=no_yes,
                             logprob_token_ids=[41_000, 5]),
              SamplingParams(temperature=0.0, logprobs=2, allowed_token_ids=three),
              SamplingParams(temperature=0.0, logprobs=3, allowed_token_ids=three),
              SamplingParams(temperature=0.0, logprobs=1, allowed_token_ids=no_yes)]
    columns = sorted({*no_yes, *three})
    values = torch.randn(4, len(columns), generator=torch.Generator().manual_seed(3)) * 4
    values[2, [columns.index(12_345), columns.index(40_001)]] = 20.0  # tied: the lower id wins
    values[3, [columns.index(t) for t in no_yes]] = float("-inf")
    whole = sample_mod.widen(values, v, tuple(columns))
    assert torch.equal(whole[:, columns], values) and bool((whole[:, 8] == float("-inf")).all())
    for params in (greedy, [*greedy[:3], SamplingParams(temperature=0.8, allowed_token_ids=no_yes)]):
        sampler, gens = Sampler(v), [torch.Generator().manual_seed(i) for i in range(4)]
        args = sampler.prepare(params, gens, columns=columns)
        assert args.compact == (params is greedy)
        got = sampler.sample(values, args)
        gens = [torch.Generator().manual_seed(i) for i in range(4)]
        # repr: the dead row's entries are NaN in both (as a whole row gives them).
        assert repr(got) == repr(sampler.sample(whole, sampler.prepare(params, gens)))
    assert got.token_ids[2] == 12_345 and got.logprobs[0].top_ids == [41_000, 5]
    assert got.logprobs[0].top_logprobs[1] == float("-inf")


def test_masked_row_whose_allowed_logits_are_all_banned() -> None:
    """Every allowed logit -inf (the caller's logits say so): the row still gets an entry, the
    way the full vocabulary gives it, beside a neighbour computed on its allowed ids."""
    v = 64
    dead = torch.randn(v)
    dead[[5, 9]] = float("-inf")
    live = torch.randn(v)
    params = [SamplingParams(temperature=0.0, logprobs=2, allowed_token_ids=[5, 9])] * 2
    sampler = Sampler(v)
    out = sampler.sample(torch.stack([dead, live]), sampler.prepare(params, [torch.Generator()] * 2))
    assert out.logprobs[1].token_id in (5, 9)
    assert out.logprobs[1].logprob == pytest.approx(
        float(live[out.logprobs[1].token_id] - torch.logsumexp(live[[5, 9]], 0)), abs=1e-6)
    assert out.logprobs[0] is not None and out.logprobs[0].token_id == out.token_ids[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_any_float_dtype_and_caller_logits_untouched(dtype: torch.dtype) -> None:
    sampler = Sampler(7)
    ps = [SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, allowed_token_ids=[1, 2]),
          SamplingParams(temperature=0.0, logprobs=1)]
    logits = torch.tensor([LOGITS, LOGITS], dtype=dtype)
    before = logits.clone()
    out = sampler.sample(logits, sampler.prepare(ps, [torch.Generator(), torch.Generator()]))
    assert torch.equal(logits, before)
    assert out.token_ids[0] in (1, 2) and out.token_ids[1] == 0
    assert out.logprobs[0] is None and out.logprobs[1] is not None


def test_logprobs_exact_over_a_large_flat_vocabulary() -> None:
    """248,320 ids (the Qwen3.5 vocabulary), three raised, the rest at 0: the normaliser is a sum
    of ~250k equal terms, where a lane-wise fp32 accumulation drifts by ~3e-4 (seen on AVX2)."""
    V, raised = 248_320, {5: 9.0, 7: 8.0, 9: 6.0}
    logits = torch.zeros(1, V)
    for i, a in raised.items():
        logits[0, i] = a
    log_z = math.log(sum(math.exp(a) for a in raised.values()) + (V - len(raised)))
    sampler = Sampler(V)
    params = [SamplingParams(temperature=0.0, logprobs=3)]
    lp = sampler.sample(logits, sampler.prepare(params, [torch.Generator()])).logprobs[0]
    assert lp is not None and lp.token_id == 5
    assert lp.top_ids == [5, 7, 9]
    assert lp.top_logprobs == pytest.approx([a - log_z for a in raised.values()], abs=2e-6)


@pytest.mark.parametrize("temperature", [1e-300, 1e-6])
def test_temperature_below_1e_5_is_greedy(temperature: float) -> None:
    # 1e-300 is 0 in float32 and 1e-6 scales logits past its range: both used to give NaN
    # probabilities and token 0. The top two are 5e-5 apart, so a sampler would pick either.
    logits = [0.5, 1.0, 1.0 + 5e-5, 0.0]
    p = SamplingParams(temperature=temperature)
    assert p.is_greedy
    assert draws(logits, p, n=200) == {2}


def test_temperature_1e_4_still_samples() -> None:
    # At T = 1e-4 the 5e-5 gap becomes 0.5: tokens 1 and 2 are drawn ~38% / 62%.
    p = SamplingParams(temperature=1e-4)
    assert not p.is_greedy
    assert draws([0.5, 1.0, 1.0 + 5e-5, 0.0], p, n=200) == {1, 2}


def test_row_logprobs_bit_identical_alone_and_in_a_batch() -> None:
    """By default a lone row's normaliser is not reduced as one of several rows' (torch splits a
    lone row's sum across threads past 32k elements); the logprobs must not tell them apart.
    Flat rows, as a small model's, are where the two sums round differently most often."""
    V, B = 49_152, 16
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, V, generator=g) * 0.3
    ps = [SamplingParams(temperature=0.0, logprobs=3)] * B
    sampler = Sampler(V)
    batched = sampler.sample(logits, sampler.prepare(ps, [torch.Generator()] * B)).logprobs
    for i in range(B):
        [alone] = sampler.sample(logits[i : i + 1], sampler.prepare(ps[:1], [g])).logprobs
        assert alone is not None and batched[i] is not None
        assert (alone.logprob, alone.top_logprobs) == (batched[i].logprob, batched[i].top_logprobs)
