"""load_tokenizer against transformers' own AutoTokenizer on the same folders, on a first load
(AutoTokenizer asked) and on a second (its choice read from the cache folder): the class (which
keys on the config's model type: phi3's is one transformers overrides) and what the tokenizer
does with text, special tokens and the chat template."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from freetoken.tokenizer.load import load_tokenizer

TEXTS = ["Hello, world!", " naïve café\n\n\tΩ", "<|im_start|>user<|im_end|>", "12345 + 678"]


def assert_same(ours, theirs):
    assert type(ours) is type(theirs)
    assert [ours(t)["input_ids"] for t in TEXTS] == [theirs(t)["input_ids"] for t in TEXTS]
    assert ours.all_special_ids == theirs.all_special_ids and ours.eos_token_id == theirs.eos_token_id
    if theirs.chat_template:
        messages = [{"role": "user", "content": TEXTS[1]}]
        assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("fixture", ["tiny_qwen3_path", "tiny_phi3_path", "tiny_mistral_path"])
def test_the_tokenizer_autotokenizer_loads_first_and_again(request, fixture, tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    folder = request.getfixturevalue(fixture)
    theirs = AutoTokenizer.from_pretrained(folder)
    assert_same(load_tokenizer(folder), theirs)
    [chosen] = json.loads((tmp_path / "tokenizer-classes.json").read_text()).values()
    assert chosen == type(theirs).__name__
    assert_same(load_tokenizer(folder), theirs)


def test_a_folder_with_its_own_tokenizer_code_is_not_remembered(tiny_qwen3_path, tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    for path in tiny_qwen3_path.iterdir():
        (folder / path.name).symlink_to(path)
    config = json.loads((tiny_qwen3_path / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {}}))
    load_tokenizer(folder)
    assert not (tmp_path / "cache" / "tokenizer-classes.json").exists()
