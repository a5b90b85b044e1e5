"""The engine's grammar pieces alone: compile cache, per-request matchers, after_ids, masks."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken.core import StructuredSpec
from freetoken.structured.grammar import ll_tokenizer
from freetoken.structured.matcher import GrammarCompiler, GrammarMasks, RequestGrammar, wait_any
from tests.model_fixtures import default_model

pytestmark = pytest.mark.slow  # the default model


@pytest.fixture(scope="module")
def model():
    return default_model()


@pytest.fixture(scope="module")
def tokenizer(model):
    return ll_tokenizer(model.tokenizer, model.vocab_size, model.eos_token_ids)


def _ids(model, text: str) -> list[int]:
    return model.tokenizer.encode(text, add_special_tokens=False)


def _resolved(grammar: RequestGrammar) -> RequestGrammar:
    wait_any([grammar], timeout=30)  # the test may wait; the scheduler never does
    assert grammar.resolve()
    return grammar


def test_compiles_once_per_kind_and_value(model, tokenizer):
    built = []
    compiler = GrammarCompiler(lambda: built.append(1) or tokenizer)
    choice = json.dumps(["yes", "no"])
    a = _resolved(compiler.start(StructuredSpec("choice", choice)))
    b = _resolved(compiler.start(StructuredSpec("choice", choice, after_ids=(5,))))
    c = _resolved(compiler.start(StructuredSpec("regex", "[0-9]+")))
    assert (compiler.compiled, compiler.cache_hits, len(built)) == (2, 1, 1)
    # Each request advances its own copy.
    assert a.matcher is not b.matcher
    for t in _ids(model, "yes"):
        assert a.advance([t]) is None
    assert a.matcher.is_accepting() and not b.matcher.is_accepting()
    assert c.matcher is not None and c.error is None


@pytest.mark.parametrize("spec, reason", [
    (StructuredSpec("regex", "[a-"), "unclosed character class"),
    (StructuredSpec("json_schema", "{not json"), ""),
    (StructuredSpec("ebnf", "x"), "unknown structured output kind"),
])
def test_compile_failure_is_the_requests_error(tokenizer, spec, reason):
    grammar = _resolved(GrammarCompiler(lambda: tokenizer).start(spec))
    assert grammar.matcher is None
    assert grammar.error.startswith("The structured output grammar does not compile: ")
    assert reason in grammar.error and "<state>" not in grammar.error


def test_free_until_after_ids_then_constrained(model, tokenizer):
    marker = tuple(_ids(model, "</answer>"))
    assert len(marker) > 1
    grammar = _resolved(GrammarCompiler(lambda: tokenizer).start(
        StructuredSpec("regex", "[0-9]{2}", after_ids=marker)))
    output: list[int] = []
    # Free text, a partial marker, then the marker: nothing reaches the matcher.
    for t in _ids(model, "Hello </") + list(marker):
        assert grammar.constraining is None
        output.append(t)
        assert grammar.advance(output) is None
    assert grammar.constraining is grammar.matcher and not grammar.matcher.is_accepting()
    for t in _ids(model, "42"):
        output.append(t)
        assert grammar.advance(output) is None
    assert grammar.matcher.is_stopped()
    output.append(_ids(model, "7")[0])  # the grammar is done: only EOS may follow
    error = grammar.advance(output)
    assert error.startswith("The output cannot continue under its grammar: ")
    assert "<state>" not in error


def test_masks_match_llguidance(model, tokenizer):
    compiler = GrammarCompiler(lambda: tokenizer)
    letters = _resolved(compiler.start(StructuredSpec("regex", "[a-z]{5,8}")))
    digits = _resolved(compiler.start(StructuredSpec("regex", "[0-9]+")))
    for t in _ids(model, "hello"):
        letters.advance([t])
    masks = GrammarMasks(model.vocab_size, torch.device("cpu"))
    banned = masks.banned([letters.matcher, None, digits.matcher])
    assert banned.shape == (3, model.vocab_size) and banned.dtype == torch.bool
    for row, matcher in ((0, letters.matcher), (2, digits.matcher)):
        # compute_logit_bias: one byte per token, 200 where allowed.
        allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
        assert torch.equal(~banned[row], allowed[: model.vocab_size] == 200)
    assert not banned[1].any()
    [eos] = model.eos_token_ids
    assert not banned[0, eos] and banned[2, eos]  # five letters accept; no digit yet does not
    assert masks.stats()["grammar_mask_steps"] == 1 and masks.stats()["grammar_mask_us"] > 0
