"""Speculative decoding (prompt lookup) changes nothing but the number of steps: every request's
tokens and logprobs are those of plain decoding, bit for bit, alone and in a batch."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace

import pytest

from freetoken.config import SpeculativeConfig
from freetoken.core import Req, SamplingParams, StructuredSpec
from freetoken.engine.mtp import MtpDrafter
from freetoken.message import UserMsg
from freetoken.scheduler.factory import build_scheduler
from freetoken.scheduler import speculation
from freetoken.scheduler.speculation import lookup
from tests.model_fixtures import default_model, loaded_fp32

SPEC = SpeculativeConfig(num_speculative_tokens=4)
MTP = SpeculativeConfig(num_speculative_tokens=3, method="mtp")

CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n\n")


def test_config_parses_vllms_spelling_and_refuses_the_rest():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                   '"prompt_lookup_max": 5}') == SpeculativeConfig(3, 1, 5)
    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2}') == MTP.__class__(
        2, method="mtp")
    for bad, says in (('{"num_speculative_tokens": 3, "draft_model": "x"}', "draft_model"),
                      ('{"method": "mtp", "num_speculative_tokens": 3, "prompt_lookup_max": 2}',
                       "prompt_lookup_max"),
                      ('{"method": "eagle", "num_speculative_tokens": 3}', "eagle"),
                      ('{"method": "ngram"}', "num_speculative_tokens"),
                      ('{"num_speculative_tokens": 0}', "[1, 64]"),
                      ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                       '"prompt_lookup_max": 2}', "prompt_lookup_min"),
                      ("[3]", "object"), ("{", "JSON")):
        with pytest.raises(ValueError, match=says.replace("[", r"\[")):
            SpeculativeConfig.parse(bad)


def test_lookup_takes_what_followed_the_latest_longest_match():
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    # [7, 8] last occurred at 5 (followed by 1, 2): the 2-gram wins over the 3-gram's absence.
    assert lookup([7, 8, 9, 9, 9, 7, 8, 1, 2, 3, 7, 8], config, 3) == (2, [1, 2, 3])
    assert lookup([7, 8, 9, 9, 9, 7, 8, 1, 2, 3, 7, 8], config, 1) == (2, [1])
    assert lookup([1, 2, 3, 4], config, 3) == (0, [])  # no earlier occurrence of any suffix
    assert lookup([5, 5, 5], config, 3) == (2, [5])  # the match may overlap the suffix
    assert lookup([1, 2, 1, 2], config, 0) == (0, [])


def test_step_cost_fit_gives_the_rows_share_of_a_step():
    cost = speculation.StepCost()
    assert cost.row_share(8) == 0.0  # nothing seen yet: drafts are not held back
    for rows in (8, 12, 9, 16, 8, 10):
        cost.observe(rows, 0.020 + 0.001 * rows)
    assert cost.row_share(8) == pytest.approx(0.008 / 0.028)
    assert cost.row_share(1) == pytest.approx(0.001 / 0.021)


def test_drafts_are_proposed_only_where_they_pay_for_their_rows():
    ids = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    speculator = speculation.Speculator(SPEC)
    req = lambda: Req(uid=0, prompt_ids=list(ids), params=SamplingParams(max_tokens=50))
    assert speculator.propose(req(), 8) == [7, 8, 5, 6]  # no cost known: the whole draft
    for rows in (8, 12, 9, 16, 8, 10):  # rows are half of a step of 8
        speculator.observe(rows, 0.008 + 0.001 * rows, 8)
    doubtful = req()
    speculator.verified(doubtful, [1, 2], 0, 1)  # nothing accepted: a pause of 1, then...
    speculator.verified(doubtful, [1, 2], 1, 2)  # ...(its pause, begun, is kept as it is)
    assert doubtful.draft_pause == 1 and speculation.acceptance(doubtful) < 0.5
    assert speculator.propose(doubtful, 8) == []  # pausing
    # 0.43 < 0.5: no token pays; after a pause, one is tried all the same, and a pause of 2 begins.
    assert speculator.propose(doubtful, 8) == [7]
    assert doubtful.draft_pause == 2
    assert speculator.propose(doubtful, 1) == [] and speculator.propose(doubtful, 1) == []
    assert speculator.propose(doubtful, 1) == [7, 8]  # at one row a row is cheap: it pays
    good = req()
    for _ in range(3):
        speculator.verified(good, [1, 2, 3, 4], 4, 5)
    assert speculator.propose(good, 8) == [7, 8, 5, 6]  # 0.91 ** 4 >= 0.5


def test_a_drafts_acceptance_is_that_of_its_match_length_too():
    speculator = speculation.Speculator(SPEC)
    for rows in (8, 12, 9, 16, 8, 10):  # rows are half of a step of 8
        speculator.observe(rows, 0.008 + 0.001 * rows, 8)
    req = lambda ids: Req(uid=0, prompt_ids=ids, params=SamplingParams(max_tokens=50))
    for _ in range(5):  # other requests' 1-gram drafts were rejected, their 4-gram ones accepted
        for n, accepted in ((1, 0), (4, 4)):
            done = req([1])
            done.draft_match = n
            speculator.verified(done, [1, 2, 3, 4], accepted, accepted + 1)
    assert speculator.propose(req([1, 2, 3, 9, 4, 5, 6, 9]), 8) == []  # only a 1-gram matches
    assert speculator.propose(req([5, 6, 7, 8, 5, 6, 7, 8]), 8) == [5, 6, 7, 8]


def test_mtp_drafts_retire_after_a_window_with_nothing_accepted():
    req = lambda: Req(uid=0, prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=200))
    speculator, wrong, steps, drafted = speculation.Speculator(MTP), req(), 0, 0
    while wrong.drafting:  # a head never accepted, at one request whose rows cost half a step
        n = speculator.length(wrong, 1)
        if n:
            speculator.verified(wrong, [0] * n, 0, 1)
            drafted += 1
        speculator.observe(1 + n, 0.010 + 0.010 * (1 + n), 1)
        steps += 1
    # One token and a plain step, three times over (the fit then knows what a row costs), then
    # steps where not even one token pays, each counted as one rejected: 8 in 11 steps.
    assert (drafted, steps) == (3, 11) and speculator.length(wrong, 1) == 0
    speculator, half = speculation.Speculator(MTP), req()  # accepted 1 token in 2: kept drafting
    for _ in range(100):
        n = speculator.length(half, 1)
        if n:
            drafted += 1
            speculator.verified(half, [0] * n, min(n, drafted % 2), 1)
    assert half.drafting


def _steps_drafted(choice, drafting_speedup, steps, noise):
    """Steps of 8 requests under `choice`: plain emits 8 tokens in 20 ms, drafting
    `drafting_speedup` times as many a second; each step's seconds off by up to `noise` (seeded)."""
    rng, drafted = random.Random(5), 0
    for _ in range(steps):
        drafts = choice.drafts(8)
        drafted += drafts
        seconds = 0.020 * (1 + rng.uniform(-noise, noise))
        choice.observe(16 if drafts else 8, seconds, round(8 * drafting_speedup) if drafts else 8)
    return drafted


@pytest.mark.parametrize("noise", [0.0, 0.2])
def test_steps_draft_in_the_mode_measured_faster_and_follow_a_change(noise):
    slower, faster = speculation.ModeChoice(), speculation.ModeChoice()
    assert _steps_drafted(slower, 0.85, 400, noise) <= 0.1 * 400
    assert _steps_drafted(faster, 1.25, 400, noise) >= 0.9 * 400
    # Drafting turns slower (the text stops repeating): within 40 steps it is mostly off.
    _steps_drafted(faster, 0.85, 40, noise)
    assert _steps_drafted(faster, 0.85, 200, noise) <= 0.1 * 200
    # Other request counts are measured apart: one request starts over, drafting first.
    assert faster.drafts(1)


def _params():
    """One request per feature that reads the output so far, sampled or scored."""
    seeded = dict(temperature=0.8, top_p=0.95, seed=11)
    return [
        SamplingParams(temperature=0, max_tokens=40, logprobs=3),
        SamplingParams(**seeded, max_tokens=40, logprobs=2),
        SamplingParams(**seeded, max_tokens=40, repetition_penalty=1.2, presence_penalty=0.3,
                       frequency_penalty=0.2),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=12, bad_words_token_ids=[[28]],
                       logit_bias={29: 2.0}),
        SamplingParams(temperature=0, max_tokens=1, logprobs=5,
                       allowed_token_ids=[318, 339, 1118]),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[1002]),
        SamplingParams(temperature=0, max_tokens=24, logprobs=1, structured=StructuredSpec(
            "json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))),
        SamplingParams(temperature=1.0, max_tokens=40, seed=3, logprobs=0),
    ]


def _prompts(tok):
    return [tok.encode(f"Copy this code exactly:\n{CODE}Copy:\n{CODE[: 10 * i]}") for i in range(8)]


def _run(loaded, requests, speculative):
    scheduler = build_scheduler(loaded, kv_slots=4096, speculative=speculative)
    for uid, (ids, params) in enumerate(requests):
        scheduler.add(UserMsg(uid, ids, params))
    out = {}
    while scheduler.has_work:
        for msg in scheduler.step():
            assert msg.error is None, msg.error
            entry = out.setdefault(msg.uid, ([], [], []))
            entry[0].extend(msg.token_ids)
            entry[1].extend(msg.logprobs)
            if msg.finished:
                entry[2].append(msg.finish_reason)
    return out, scheduler.stats()


def _requests(loaded):
    return list(zip(_prompts(loaded.tokenizer), _params()))


def _pinned(monkeypatch):
    """The draft policy pinned, not left to the steps' timing: every draft token pays for its row,
    and every fourth step runs plain. What the test counts then does not hang on the machine's
    load, and a switch between drafting and plain steps must change no output."""
    steps = itertools.count()
    monkeypatch.setattr(speculation.ModeChoice, "drafts", lambda self, requests: next(steps) % 4 != 3)
    monkeypatch.setattr(speculation.StepCost, "known", property(lambda self: True))
    monkeypatch.setattr(speculation.StepCost, "row_share", lambda self, rows: 0.0)


@pytest.mark.slow
def test_default_model_batched_and_alone_equal_plain_decoding_bit_for_bit(monkeypatch):
    _pinned(monkeypatch)
    loaded = default_model()
    requests = _requests(loaded)
    plain, _ = _run(loaded, requests, None)
    fresh = _requests(loaded)  # params are consumed (max_tokens filled in): a new set each run
    drafted, stats = _run(loaded, fresh, SPEC)
    assert drafted == plain
    # The test verifies drafts, and accepts some: a test where every draft failed would not
    # show the rewind of a seeded stream after accepted rows.
    assert stats["spec_decode_num_accepted_tokens"] > 20, stats
    for uid, request in enumerate(_requests(loaded)):
        alone, _ = _run(loaded, [request], SPEC)
        assert alone[0] == plain[uid], uid


@pytest.mark.slow
def test_a_request_that_opts_out_is_never_drafted():
    loaded = default_model()
    ids = loaded.tokenizer.encode(CODE * 3)
    out, stats = _run(loaded, [(ids, SamplingParams(temperature=0, max_tokens=16, speculative=False))],
                      SPEC)
    assert stats["spec_decode_num_drafts"] == 0
    drafted, stats = _run(loaded, [(ids, SamplingParams(temperature=0, max_tokens=16))], SPEC)
    assert stats["spec_decode_num_drafts"] > 0
    assert drafted == out


@pytest.mark.slow
def test_moe_fixture_equals_plain_decoding(tiny_qwen3_moe_path):
    loaded = loaded_fp32(tiny_qwen3_moe_path)
    tok = loaded.tokenizer
    # A random model repeats itself: its own output is what the drafts are looked up in.
    requests = lambda: [(tok.encode(f"{i} {CODE[:20]}"), p) for i, p in enumerate(_params())]
    plain, _ = _run(loaded, requests(), None)
    drafted, stats = _run(loaded, requests(), SPEC)
    assert drafted == plain
    assert stats["spec_decode_num_drafts"] > 0, stats


def _oracle(monkeypatch, prompts, outputs):
    """Drafts taken from the plain outputs (a random model rarely repeats itself in a few
    tokens), every third one with its last token wrong: drafts accepted whole and in part.
    MTP drafts are drafted by the head all the same (its K/V written), then replaced."""

    def lookup(ids, config, most):
        for prompt, out in zip(prompts, outputs):
            if ids[: len(prompt)] == prompt:
                done = len(ids) - len(prompt)
                draft = out[done : done + most]
                if draft and done % 3 == 0:
                    draft[-1] = (draft[-1] + 1) % 1000
                return 1, draft
        return 0, []

    def draft(self, reqs, lengths):
        return [lookup(r.all_ids, None, len(d))[1] or d for r, d in zip(reqs, real(self, reqs, lengths))]

    monkeypatch.setattr(speculation, "lookup", lookup)
    real = MtpDrafter.draft
    monkeypatch.setattr(MtpDrafter, "draft", draft)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3_5_text", "qwen3_next"])
def test_hybrid_fixtures_equal_plain_decoding(tiny_hybrid_path, variant, monkeypatch):
    # The recurrent layers run a draft's rows one round each, from the state the row before
    # left, and keep the state of the last accepted row: later steps would show a wrong one.
    loaded = loaded_fp32(tiny_hybrid_path(variant))
    tok = loaded.tokenizer
    # A 248k vocabulary: the sampler's rows dominate, so four requests of the list, shorter.
    requests = lambda: [(tok.encode(f"{i} {CODE[:30]}"), replace(p, max_tokens=min(p.max_tokens, 16)))
                        for i, p in enumerate(_params()) if i in (0, 1, 2, 7)]
    plain, _ = _run(loaded, requests(), None)
    _oracle(monkeypatch, [ids for ids, _ in requests()], [plain[uid][0] for uid in range(4)])
    drafted, stats = _run(loaded, requests(), SPEC)
    assert drafted == plain
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    for uid in (0, 1):  # greedy and seeded top-p, alone
        alone, _ = _run(loaded, [requests()[uid]], SPEC)
        assert alone[0] == plain[uid], uid


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "speculative"), [("qwen3_5_text", SPEC), ("qwen3_5_mtp", MTP)],
                         ids=["ngram", "mtp"])
def test_hybrid_drafts_survive_preemption_and_the_prefix_cache(tiny_hybrid_path, variant, speculative,
                                                               monkeypatch):
    # 150 KV slots for four 67-token prompts (66 shared) and their 24-token outputs: requests are
    # preempted and recomputed whatever the drafts, and a prompt's snapshot serves the next
    # request's cache hit.
    loaded = loaded_fp32(tiny_hybrid_path(variant))
    tok = loaded.tokenizer
    shared = tok.encode(CODE * 2)[:66]
    requests = lambda: [(shared + [100 + i], SamplingParams(temperature=0.8, seed=i, max_tokens=24))
                        for i in range(4)]
    expected = [_run(loaded, [request], None)[0][0][0] for request in requests()]
    _oracle(monkeypatch, [ids for ids, _ in requests()], expected)
    scheduler = build_scheduler(loaded, kv_slots=150, speculative=speculative, state_snapshots=2,
                                max_running_requests=4)
    out = {}
    for uid, request in enumerate(requests()):
        scheduler.add(UserMsg(uid, *request))
    while scheduler.has_work:
        for msg in scheduler.step():
            out.setdefault(msg.uid, []).extend(msg.token_ids)
    stats = scheduler.stats()
    assert stats["preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert stats["prefix_cache_hits"] > 0, stats
    assert [out[uid] for uid in range(4)] == expected


@pytest.mark.slow
def test_mtp_fixture_equals_plain_decoding_batched_and_alone(tiny_hybrid_path, monkeypatch):
    # Every feature of _params (logprobs, allowed_token_ids, a JSON-schema grammar, stop ids,
    # penalties, greedy and seeded), eight requests together, then each alone.
    loaded = loaded_fp32(tiny_hybrid_path("qwen3_5_mtp"))
    tok = loaded.tokenizer
    requests = lambda: [(tok.encode(f"{i} {CODE[:30]}"), replace(p, max_tokens=min(p.max_tokens, 12)))
                        for i, p in enumerate(_params())]
    plain, _ = _run(loaded, requests(), None)
    _oracle(monkeypatch, [ids for ids, _ in requests()], [plain[uid][0] for uid in range(8)])
    drafted, stats = _run(loaded, requests(), MTP)
    assert drafted == plain
    assert stats["spec_decode_method"] == "mtp"
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    for uid, request in enumerate(requests()):
        alone, _ = _run(loaded, [request], MTP)
        assert alone[0] == plain[uid], uid
