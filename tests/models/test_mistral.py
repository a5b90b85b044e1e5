"""Mistral through the llama family against transformers' MistralForCausalLM on the same tiny
checkpoint (a sliding window on every layer, shorter than the prompts), batch and cache
invariance, and the `llama` GGUF llama.cpp makes of a Mistral."""

from __future__ import annotations

import pytest

from freetoken.models.llama import LlamaForCausalLM
from freetoken.models.registry import load_model
from freetoken.scheduler.factory import build_scheduler
from tests.model_fixtures import (HARMONY_TEXTS, assert_batch_matches_alone_and_reference,
                                  assert_cache_hit_and_chunks_give_the_cold_result, assert_matches_reference,
                                  assert_same_run, greedy_run)


@pytest.fixture(scope="module")
def loaded(tiny_mistral_path):
    return load_model(tiny_mistral_path, dtype="float32", device="cpu")


def test_every_layer_slides_in_a_window_shorter_than_the_prompts(loaded):
    cfg = loaded.model.cfg
    assert type(loaded.model) is LlamaForCausalLM
    assert cfg.sliding_window == 8 and cfg.sliding_layers == {0, 1}
    assert min(len(loaded.tokenizer.encode(t)) for t in HARMONY_TEXTS) > cfg.sliding_window


def test_batch_of_8_matches_transformers_and_each_alone(loaded):
    assert_batch_matches_alone_and_reference(loaded, HARMONY_TEXTS)


def test_prefix_hit_and_chunked_prefill_give_the_cold_result(loaded):
    base = loaded.tokenizer.encode(HARMONY_TEXTS[0] + " " + HARMONY_TEXTS[3])
    cached = assert_cache_hit_and_chunks_give_the_cold_result(loaded, base)
    assert cached[0] >= len(base) - 1 and cached[1] >= len(base) - 4 > 2 * 8


def test_its_llama_gguf_loads_as_its_hf_folder():
    """llama.cpp writes a Mistral as a `llama` GGUF (q/k rows permuted): read in place, it runs
    as the HF folder does, which matches transformers' Mistral."""
    from tests.fixtures import build_models as bm

    built = bm.cached("tiny-mistral-gguf", bm.build_mistral_gguf)
    from_gguf = load_model(built / "model.gguf", dtype="float32", device="cpu")
    from_folder = load_model(built / "hf", dtype="float32", device="cpu")
    assert from_gguf.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert from_folder.hf_config["architectures"] == ["MistralForCausalLM"]
    prompt = from_folder.tokenizer.encode(HARMONY_TEXTS[0])
    runs = [greedy_run(build_scheduler(loaded, kv_slots=256), {0: prompt}, steps=8)[0][0]
            for loaded in (from_gguf, from_folder)]
    assert_same_run(*runs, tol=1e-6)
    assert_matches_reference(built / "hf", prompt, runs[1])
