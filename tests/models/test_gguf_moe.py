"""Qwen3-MoE and Qwen2-MoE GGUF files read as stored: the experts kept in their block formats (grouped
quantized kernel) against transformers' float32 run on the same file dequantized, batch
invariance, weight bytes, and a file whose experts do not fit the config."""

from __future__ import annotations

import logging

import pytest
import torch

from freetoken.config import WeightsConfig
from freetoken.models import registry
from freetoken.layers.moe import Experts
from freetoken.paths import ModelNotFound
from tests.fixtures import build_models as bm
from tests.model_fixtures import (assert_config_edit_is_named,
                                  assert_holds_stored_bytes_and_matches_reference,
                                  assert_matches_reference, assert_same_run, greedy_run, stored_bytes)

MIXES = ("Q8_0", "Q4_K", "Q4_K_M")
# name -> mix: Qwen3-MoE in each mix, Qwen2-MoE (a shared expert, q/k/v biases) in Q4_K_M.
MODELS = {**{mix: mix for mix in MIXES}, "qwen2moe": "Q4_K_M"}
PROMPTS = {0: [5, 6, 7, 8, 9, 10, 11], 1: [100, 200, 300]}


@pytest.fixture(scope="module")
def built():
    return {name: bm.cached_gguf(f"tiny-quantized-moe-{name}") for name in MODELS}


@pytest.fixture(scope="module")
def loaded(built):
    return {name: registry.load_model(path / "model.gguf", dtype="float32", device="cpu", weights=WeightsConfig(gguf_weights="quantized"))
            for name, path in built.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_experts_stay_quantized_and_match_transformers(name, built, loaded):
    from freetoken.layers.quantized import QuantizedLinear
    from freetoken.scheduler.factory import build_scheduler

    model, mix = loaded[name], MODELS[name]
    layers = [m for m in model.model.modules() if isinstance(m, Experts)]
    assert len(layers) == 2 and all(m.experts is None and m.stacked is None for m in layers)
    held = layers[0].quantized
    assert [w.qtype.name for w in held.weights] == ["Q4_K" if mix == "Q4_K_M" else mix] * 2 + \
        ["Q6_K" if mix == "Q4_K_M" else mix]
    assert [tuple(w.shape) for w in held.weights] == [(8, 256, 256)] * 3
    if name == "qwen2moe":
        shared = model.model.model.layers[0].mlp.shared_expert
        assert isinstance(shared.gate_up_proj, QuantizedLinear) and isinstance(shared.down_proj, QuantizedLinear)
    stored = stored_bytes(built[name] / "model.gguf", MIXES + ("Q6_K",))
    together = assert_holds_stored_bytes_and_matches_reference(model, stored, PROMPTS)
    for uid, ids in PROMPTS.items():
        alone, _ = greedy_run(build_scheduler(model, kv_slots=256, prefix_cache=False), {uid: ids}, steps=6)
        assert_same_run(together[uid], alone[uid], tol=0.0)


def test_experts_without_a_kernel_are_dequantized_at_load_with_a_log_line(built, monkeypatch, caplog):
    """Q6_K without a kernel: layer 0's experts (down in Q6_K) come out float, layer 1's stay,
    as the memory check planned them."""
    from freetoken.models import gguf_file

    monkeypatch.setattr(gguf_file, "supported", lambda qtype: qtype.name != "Q6_K")
    with caplog.at_level(logging.INFO):
        model = registry.load_model(built["Q4_K_M"] / "model.gguf", dtype="float32", device="cpu",
                                    weights=WeightsConfig(gguf_weights="quantized"))
    first, second = (model.model.model.layers[i].mlp for i in (0, 1))
    assert first.quantized is None and second.quantized is not None
    # Layer 0's Q4_K gate and up are widened with its Q6_K down, and planned so.
    planned = gguf_file.planned_bytes(gguf_file.open_gguf(built["Q4_K_M"] / "model.gguf"), torch.float32, True)
    assert model.model.weight_bytes == planned and set(planned) == {"Q4_K", "float32"}
    assert "experts of 1 layers (model.layers.0.mlp) dequantized at load" in caplog.text


def test_experts_that_do_not_fit_the_config_are_named(built, tmp_path):
    assert_config_edit_is_named(built["Q8_0"] / "model.gguf", tmp_path, [
        ({'"num_local_experts": 8': '"num_local_experts": 6'},
         r"tensor blk\.0\.ffn_gate_inp\.weight is \[8, 256\], the config says \[6, 256\]"),
        ({'"num_local_experts": 6': '"num_local_experts": 8',
          '"moe_intermediate_size": 256': '"moe_intermediate_size": 512'},
         r"tensor blk\.0\.ffn_gate_exps\.weight is \[8, 256, 256\], the config says \[8, 512, 256\]"),
    ])


def test_float32_experts_are_the_dequantized_blocks_refused_where_their_load_does_not_fit(built, monkeypatch):
    """FREETOKEN_GGUF_WEIGHTS=float32: the experts dequantized at load (transformers' run on the
    same file is the reference); the memory check counts, beyond the weights, the layer of
    experts the load concatenates and repacks at a time."""
    from freetoken.models import gguf_file, loader
    from freetoken.scheduler.factory import build_scheduler

    path = built["Q4_K_M"] / "model.gguf"
    weights = sum(gguf_file.planned_bytes(gguf_file.open_gguf(path), torch.float32, False).values())
    kv = 2 * 2 * 2 * 64 * 256 * 4  # layers x KV heads x head_dim x slots x (K and V) x 4 bytes
    monkeypatch.setattr(loader, "available_memory", lambda: weights + kv + 1)
    with pytest.raises(ModelNotFound, match=r"of KV pool \+ 0\.01 GiB while loading, but"):
        registry.load_model(path, dtype="float32", device="cpu", kv_slots=256, weights=WeightsConfig(gguf_weights="float32"))
    monkeypatch.setattr(loader, "available_memory", lambda: None)
    model = registry.load_model(path, dtype="float32", device="cpu", kv_slots=256, weights=WeightsConfig(gguf_weights="float32"))
    assert model.model.weight_bytes == {"float32": weights}
    assert all(m.quantized is None for m in model.model.modules() if isinstance(m, Experts))
    together, _ = greedy_run(build_scheduler(model, kv_slots=256, prefix_cache=False), PROMPTS, steps=6)
    for uid, ids in PROMPTS.items():
        assert_matches_reference(model.folder, ids, together[uid])
