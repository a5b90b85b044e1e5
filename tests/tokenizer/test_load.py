"""load_tokenizer against transformers' own AutoTokenizer on the same folders: the class it
chooses (which keys on the config's model type: phi3's is one transformers overrides) and what
the tokenizer does with text, special tokens and the chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from freetoken.tokenizer.load import load_tokenizer

TEXTS = ["Hello, world!", " naïve café\n\n\tΩ", "<|im_start|>user<|im_end|>", "12345 + 678"]


@pytest.mark.parametrize("fixture", ["tiny_qwen3_path", "tiny_phi3_path", "tiny_mistral_path"])
def test_the_tokenizer_autotokenizer_loads(request, fixture):
    folder = request.getfixturevalue(fixture)
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(theirs)
    assert [ours(t)["input_ids"] for t in TEXTS] == [theirs(t)["input_ids"] for t in TEXTS]
    assert ours.all_special_ids == theirs.all_special_ids and ours.eos_token_id == theirs.eos_token_id
    if theirs.chat_template:
        messages = [{"role": "user", "content": TEXTS[1]}]
        assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
