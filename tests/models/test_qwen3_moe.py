"""Qwen3-MoE and Qwen2-MoE against transformers on the same tiny checkpoints, and batch / cache
invariance."""

from __future__ import annotations

import pytest

from freetoken.models.registry import load_model
from freetoken.models.qwen3_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, SparseMoeBlock
from tests.model_fixtures import assert_batch_matches_alone_and_reference, assert_cache_hit_and_chunks_give_the_cold_result

TEXTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:",
         "Once upon a time, in a land far away,", "Count with me: " + ", ".join(str(n) for n in range(1, 17)),
         "<think>\nThe user asks", "1 2 3 4", "Write a haiku about the sea and the wind over the waves",
         '{"name": "get_weather", "arguments": {']


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def loaded(request):
    return load_model(request.getfixturevalue(f"tiny_{request.param}_path"), dtype="float32", device="cpu")


def test_layers_follow_mlp_only_layers(loaded):
    qwen2 = isinstance(loaded.model, Qwen2MoeForCausalLM)
    assert isinstance(loaded.model, Qwen3MoeForCausalLM) and loaded.model.cfg.qk_norm != qwen2
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in loaded.model.model.layers]
    assert kinds == [True, False, True]  # mlp_only_layers=[1]
    sparse = loaded.model.model.layers[0]
    assert hasattr(sparse.mlp, "shared_expert") == qwen2
    # Computed in tensor-parallel parts (models/layers/parts.py); o_proj's bias is its first part's.
    assert all((part.bias is not None) == qwen2 for part in sparse.self_attn.qkv_proj.parts)
    assert all(part.bias is None for part in sparse.self_attn.o_proj.parts)


def test_batch_of_8_matches_transformers_and_each_alone(loaded):
    assert_batch_matches_alone_and_reference(loaded, TEXTS)


def test_prefix_hit_and_chunked_prefill_give_the_cold_result(loaded):
    base = loaded.tokenizer.encode(TEXTS[3])
    cached = assert_cache_hit_and_chunks_give_the_cold_result(loaded, base, steps=8)
    assert cached[0] >= len(base) - 1 and cached[1] >= len(base) - 4
