"""The sampler's grammar mask on fake logits over the default model's vocabulary: what a grammar
row may sample, EOS, allowed ids, logprobs, batch invariance, and rows without a grammar."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from freetoken.core import SamplingParams, StructuredSpec
from freetoken.engine.sample import Sampler
from freetoken.structured.grammar import ll_tokenizer
from freetoken.structured.matcher import GrammarCompiler, RequestGrammar, wait_any
from tests.model_fixtures import default_model

pytestmark = pytest.mark.slow  # the default model


@pytest.fixture(scope="module")
def model():
    return default_model()


@pytest.fixture(scope="module")
def compiler(model):
    return GrammarCompiler(lambda: ll_tokenizer(model.tokenizer, model.vocab_size,
                                                model.eos_token_ids))


def _matcher(compiler, kind: str, value: str, consumed: list[int] = ()):
    grammar: RequestGrammar = compiler.start(StructuredSpec(kind, value))
    wait_any([grammar], timeout=30)
    assert grammar.resolve() and grammar.matcher is not None
    for t in consumed:
        assert grammar.matcher.consume_token(t)
    return grammar.matcher


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _sample(model, logits, params, grammars, seeds=None):
    sampler = Sampler(model.vocab_size, eos_token_ids=tuple(model.eos_token_ids))
    gens = [torch.Generator().manual_seed(s) for s in (seeds or range(len(params)))]
    return sampler.sample(logits, sampler.prepare(params, gens, None, grammars))


def _text(model, ids: list[int]) -> str:
    return model.tokenizer.decode(ids)


def test_grammar_rows_sample_only_what_it_allows(model, compiler):
    digits = [_matcher(compiler, "regex", "[0-9]{3}") for _ in range(4)]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_p=0.9, top_k=50), SamplingParams(min_p=0.1)]
    for seed in range(5):
        out = _sample(model, _logits(5, model.vocab_size, seed), params + [SamplingParams()],
                      digits + [None], [seed * 10 + i for i in range(5)])
        for t in out.token_ids[:4]:
            assert _text(model, [t]).isdigit()
        # A row without a grammar is free: it samples from the whole vocabulary.
        assert not _text(model, out.token_ids[4:]).isdigit()


def test_eos_only_where_the_grammar_accepts(model, compiler):
    [eos] = model.eos_token_ids
    hello = model.tokenizer.encode("hello", add_special_tokens=False)
    logits = _logits(2, model.vocab_size)
    logits[:, eos] = 100.0  # the model wants to stop at once
    rows = [_matcher(compiler, "regex", "[a-z]{5,8}"),
            _matcher(compiler, "regex", "[a-z]{5,8}", hello)]
    out = _sample(model, logits, [SamplingParams(temperature=0)] * 2, rows)
    assert out.token_ids[0] != eos and _text(model, out.token_ids[:1]).isalpha()
    assert out.token_ids[1] == eos
    # A stopped grammar allows EOS alone, whatever the logits.
    logits[:, eos] = -100.0
    done = _matcher(compiler, "choice", json.dumps(["yes", "no"]),
                    model.tokenizer.encode("no", add_special_tokens=False))
    assert done.is_stopped()
    out = _sample(model, logits[:1], [SamplingParams(temperature=1.0)], [done])
    assert out.token_ids == [eos]


def test_allowed_ids_intersect_the_grammar_and_logprobs(model, compiler):
    """A row with allowed_token_ids samples from, and gets logprobs renormalised over, its
    allowed ids that the grammar allows; a grammar row without them gets raw logprobs."""
    vocab = model.tokenizer.get_vocab()
    digits, letters = [vocab[c] for c in "0123456789"], [vocab[c] for c in "abcxyz"]
    allowed = digits[:4] + letters
    logits = _logits(3, model.vocab_size, seed=3)
    raw = torch.log_softmax(logits.double(), dim=-1)
    params = [SamplingParams(temperature=1.0, logprobs=5, allowed_token_ids=allowed),
              SamplingParams(temperature=0, logprobs=5),
              SamplingParams(temperature=0, logprobs=5, allowed_token_ids=allowed)]
    grammars = [_matcher(compiler, "regex", "[0-9]+"), _matcher(compiler, "regex", "[0-9]+"), None]
    out = _sample(model, logits, params, grammars)
    # Row 0: allowed ∩ grammar = the four digits.
    lp = out.logprobs[0]
    assert out.token_ids[0] in digits[:4] and sorted(lp.top_ids) == sorted(digits[:4])
    assert math.isclose(sum(math.exp(v) for v in lp.top_logprobs), 1.0, rel_tol=1e-5)
    expected = raw[0, digits[:4]] - raw[0, digits[:4]].logsumexp(0)
    sampled = digits[:4].index(out.token_ids[0])
    assert lp.logprob == pytest.approx(float(expected[sampled]), abs=1e-5)
    # Row 1: samples the best digit, but its logprobs are the raw distribution's.
    best = max(range(10), key=lambda i: float(logits[1, digits[i]]))
    lp = out.logprobs[1]
    assert out.token_ids[1] == digits[best] and lp.logprob == pytest.approx(
        float(raw[1, digits[best]]), abs=1e-5)
    assert lp.top_ids == raw[1].topk(5).indices.tolist()
    assert lp.rank == int((raw[1] > raw[1, digits[best]]).sum()) + 1
    # Row 2, without a grammar: its allowed ids alone.
    assert set(out.logprobs[2].top_ids) <= set(allowed) and out.token_ids[2] in allowed


def test_grammar_rows_do_not_depend_on_their_batch(model, compiler):
    r = random.Random(0)
    specs = [("regex", "[0-9]{3}"), None, ("choice", json.dumps(["alpha", "beta"])), None,
             ("json_schema", json.dumps({"type": "object"})), ("regex", "[a-z ]+")]
    params = [SamplingParams(temperature=r.choice([0, 0.8, 1.0]), top_p=r.choice([1.0, 0.9]),
                             logprobs=r.choice([None, 0, 3]),
                             allowed_token_ids=r.choice([None, list(range(100, 30000))]))
              for _ in specs]
    logits = _logits(len(specs), model.vocab_size, seed=7)

    def grammars():
        return [None if s is None else _matcher(compiler, *s) for s in specs]

    together = _sample(model, logits, params, grammars(), range(len(specs)))
    for i, g in enumerate(grammars()):
        alone = _sample(model, logits[i : i + 1], params[i : i + 1], [g], [i])
        assert alone.token_ids[0] == together.token_ids[i]
        assert alone.logprobs[0] == together.logprobs[i]  # every float bit


def test_rows_without_a_grammar_pay_nothing(model):
    sampler = Sampler(model.vocab_size)
    args = sampler.prepare([SamplingParams()] * 3, [torch.Generator()] * 3, None, [None] * 3)
    assert args.mask is None and args.sample_mask is None
    assert sampler.grammar_masks.steps == 0
