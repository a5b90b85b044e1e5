"""bad_words -> token sequences, by vLLM's rule, on the default model's byte-level BPE."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from freetoken.tokenizer.tokenize import bad_words_token_ids
from tests.model_fixtures import default_folder


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_folder())


@pytest.mark.slow
@pytest.mark.parametrize("word, pieces", [
    ("hello", [["hello"], ["Ġhello"]]),
    ("  hello", [["hello"], ["Ġhello"]]),  # leading spaces do not count
    ("world peace", [["world", "Ġpeace"], ["Ġworld", "Ġpeace"]]),
    ("antidisestablishment", [["ant", "idis", "establish", "ment"],
                              ["Ġant", "idis", "establish", "ment"]]),
    ("ß", [["ÃŁ"]]),  # after a space it takes 2 tokens, not 1: only the bare spelling
    ("", []),
    ("  ", []),
])
def test_each_word_bare_and_after_a_space(tokenizer, word: str, pieces: list[list[str]]) -> None:
    got = bad_words_token_ids(tokenizer, [word])
    assert [tokenizer.convert_ids_to_tokens(ids) for ids in got] == pieces


@pytest.mark.slow
def test_words_keep_their_order(tokenizer) -> None:
    words = ["hello", "ß", "world peace"]
    assert bad_words_token_ids(tokenizer, words) == [
        ids for word in words for ids in bad_words_token_ids(tokenizer, [word])]


class _PrefixSpaceTokenizer:
    """Like a sentencepiece tokenizer that adds the prefix space itself: " x" encodes as "x"."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert not add_special_tokens
        return [ord(c) for c in text.lstrip()]


def test_same_first_token_after_a_space_is_not_repeated() -> None:
    assert bad_words_token_ids(_PrefixSpaceTokenizer(), ["ab", " c"]) == [[97, 98], [99]]
