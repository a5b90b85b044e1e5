"""SmolLM3 through the llama family against transformers' SmolLM3ForCausalLM on the same tiny
checkpoint (a layer without rotary embedding), in Python and in the decoder layer's C call, batch
and cache invariance."""

from __future__ import annotations

import pytest

from freetoken.models.llama import LlamaForCausalLM, ModelConfig
from freetoken.models.registry import load_model
from tests.model_fixtures import (HARMONY_TEXTS, assert_batch_matches_alone_and_reference,
                                  assert_cache_hit_and_chunks_give_the_cold_result)


@pytest.fixture(scope="module")
def loaded(tiny_smollm3_path):
    return load_model(tiny_smollm3_path, dtype="float32", device="cpu")


def test_the_fourth_layer_has_no_rotary_embedding(loaded):
    assert type(loaded.model) is LlamaForCausalLM
    assert loaded.model.cfg.unrotated_layers == {3} and not loaded.model.cfg.sliding_layers
    assert [layer.self_attn.rotary for layer in loaded.model.model.layers] == [True, True, True, False]


def test_layers_a_config_does_not_list_follow_transformers_defaults():
    """Without no_rope_layers and layer_types, every no_rope_layer_interval-th layer is unrotated
    and, with a window on, slides: as transformers' SmolLM3Config fills them in."""
    from transformers import SmolLM3Config

    fields = dict(num_hidden_layers=9, no_rope_layer_interval=3, use_sliding_window=True, sliding_window=16,
                  vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    reference = SmolLM3Config(**fields)
    cfg = ModelConfig.from_hf({**fields, "architectures": ["SmolLM3ForCausalLM"]})
    assert cfg.unrotated_layers == {i for i, rotary in enumerate(reference.no_rope_layers) if not rotary} == {2, 5, 8}
    assert cfg.sliding_layers == {i for i, t in enumerate(reference.layer_types) if t == "sliding_attention"}


def test_batch_of_8_matches_transformers_and_each_alone(loaded):
    assert_batch_matches_alone_and_reference(loaded, HARMONY_TEXTS)


def test_prefix_hit_and_chunked_prefill_give_the_cold_result(loaded):
    base = loaded.tokenizer.encode(HARMONY_TEXTS[0] + " " + HARMONY_TEXTS[3])
    cached = assert_cache_hit_and_chunks_give_the_cold_result(loaded, base)
    assert cached[0] >= len(base) - 1 and cached[1] >= len(base) - 4


def test_every_layer_in_the_c_call_matches_transformers(tiny_smollm3_path, monkeypatch):
    """On the grouped kernel every layer, the unrotated one too, runs in decoder_layer.c's one
    call a step (models/kernels/decoder_layer.py), where the machine has the C kernels."""
    from freetoken.models.kernels import decoder_layer

    if decoder_layer.load() is None:
        pytest.skip("no C kernels on this machine")
    monkeypatch.setenv("FREETOKEN_LINEAR_KERNEL", "grouped")
    on_grouped = load_model(tiny_smollm3_path, dtype="float32", device="cpu")
    monkeypatch.delenv("FREETOKEN_LINEAR_KERNEL")
    assert_batch_matches_alone_and_reference(on_grouped, HARMONY_TEXTS[:4])
    assert all(layer.one_call is not None for layer in on_grouped.model.model.layers)
    assert on_grouped.model.model.stack is not None
