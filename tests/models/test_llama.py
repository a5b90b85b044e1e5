"""Our forward against transformers on the same weights (an independent implementation)."""

from __future__ import annotations

import pytest

from freetoken.models.registry import load_model
from tests.model_fixtures import assert_greedy_matches_hf, default_model, tiny_random_folder

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           # 54 tokens: decoding crosses 64 keys, where a request's padded key block grows
           # (engine.DECODE_KV_BLOCK).
           "Count with me: " + ", ".join(str(n) for n in range(1, 17))]


@pytest.mark.slow
def test_default_model_matches_transformers():
    assert_greedy_matches_hf(default_model(), PROMPTS)


def test_tiny_random_qwen3_matches_transformers():
    loaded = load_model(tiny_random_folder("qwen3"), dtype="float32", device="cpu")
    assert loaded.model.cfg.qk_norm and not loaded.model.cfg.tie_word_embeddings
    assert_greedy_matches_hf(loaded, PROMPTS)


def test_tiny_random_qwen2_matches_transformers():
    loaded = load_model(tiny_random_folder("qwen2"), dtype="float32", device="cpu")
    assert loaded.model.cfg.attention_bias and not loaded.model.cfg.qk_norm
    assert_greedy_matches_hf(loaded, PROMPTS)
