"""Qwen3-MoE against transformers on the same tiny checkpoint, and batch / cache invariance."""

from __future__ import annotations

import pytest

from freetoken.models.loader import load_model
from freetoken.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock
from freetoken.scheduler.factory import build_scheduler
from tests.model_fixtures import assert_matches_reference, assert_same_run, greedy_run

TEXTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:",
         "Once upon a time, in a land far away,", "Count with me: " + ", ".join(str(n) for n in range(1, 17)),
         "<think>\nThe user asks", "1 2 3 4", "Write a haiku about the sea and the wind over the waves",
         '{"name": "get_weather", "arguments": {']


@pytest.fixture(scope="module")
def loaded(tiny_qwen3_moe_path):
    return load_model(tiny_qwen3_moe_path, dtype="float32", device="cpu")


def test_layers_follow_mlp_only_layers(loaded):
    assert isinstance(loaded.model, Qwen3MoeForCausalLM) and loaded.model.cfg.qk_norm
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in loaded.model.model.layers]
    assert kinds == [True, False, True]  # mlp_only_layers=[1]


def test_batch_of_8_matches_transformers_and_each_alone(loaded):
    prompts = {uid: loaded.tokenizer.encode(text) for uid, text in enumerate(TEXTS)}
    together, _ = greedy_run(build_scheduler(loaded, kv_slots=1024, prefix_cache=False), prompts)
    for uid, ids in prompts.items():
        alone, _ = greedy_run(build_scheduler(loaded, kv_slots=256, prefix_cache=False), {uid: ids})
        assert_same_run(together[uid], alone[uid])
        assert_matches_reference(loaded.folder, ids, together[uid])


def test_prefix_hit_and_chunked_prefill_give_the_cold_result(loaded):
    base = loaded.tokenizer.encode(TEXTS[3])
    prompts = {0: base, 1: base[:-3] + loaded.tokenizer.encode(" and back")}
    cold, _ = greedy_run(build_scheduler(loaded, kv_slots=1024, prefix_cache=False), prompts, steps=8)
    warm = build_scheduler(loaded, kv_slots=1024)
    greedy_run(warm, {9: base}, steps=8)
    hit, cached = greedy_run(warm, prompts, steps=8)
    assert cached[0] >= len(base) - 1 and cached[1] >= len(base) - 4
    chunked, _ = greedy_run(build_scheduler(loaded, kv_slots=1024, prefix_cache=False,
                                            max_prefill_tokens=5), prompts, steps=8)
    for uid in prompts:
        assert_same_run(hit[uid], cold[uid])
        assert_same_run(chunked[uid], cold[uid])
