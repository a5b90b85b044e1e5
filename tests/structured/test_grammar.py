"""grammar.py's llguidance tokenizer: the serialised tokenizer it builds without llguidance.hf's
clone is the one llguidance.hf builds, and a padded tokenizer is left as it was."""

from __future__ import annotations

import llguidance
import llguidance.hf
import pytest

from freetoken.structured.grammar import ll_tokenizer
from tests.model_fixtures import tiny_random_folder


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_random_folder("qwen3"))


def same_view(ours: llguidance.LLTokenizer, theirs: llguidance.LLTokenizer, tok) -> None:
    assert (ours.vocab_size, ours.eos_tokens) == (theirs.vocab_size, theirs.eos_tokens)
    assert all(ours.decode_bytes([i]) == theirs.decode_bytes([i]) for i in range(len(tok)))
    assert [ours.is_special_token(i) for i in range(len(tok))] == \
        [theirs.is_special_token(i) for i in range(len(tok))]
    text = "<tool_call>{\"a\": 1}</tool_call> Oslo, naïve 42"
    assert ours.tokenize_str(text) == theirs.tokenize_str(text)


@pytest.mark.parametrize("eos", [None, [0, 2]])
def test_the_tokenizer_is_llguidance_hfs_own(tokenizer, eos):
    ours = ll_tokenizer(tokenizer, len(tokenizer), eos)
    same_view(ours, llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=eos), tokenizer)


def test_a_padded_tokenizer_is_served_unpadded_and_left_padded(tokenizer):
    from transformers import AutoTokenizer

    padded = AutoTokenizer.from_pretrained(tiny_random_folder("qwen3"))
    padded.backend_tokenizer.enable_padding(length=64)
    padded.backend_tokenizer.enable_truncation(max_length=64)
    same_view(ll_tokenizer(padded, len(padded)), ll_tokenizer(tokenizer, len(tokenizer)), tokenizer)
    assert padded.backend_tokenizer.padding is not None and padded.backend_tokenizer.truncation is not None
