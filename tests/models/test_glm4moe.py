"""GLM-4.5 (models/glm4_moe.py) against transformers on the same weights: its router against
transformers' Glm4MoeTopkRouter (groups, correction bias), and the tiny Glm4MoeForCausalLM (a
dense first layer, then experts in 4 groups with a shared one, q/k/v biases, q/k norm, rotary on
half of each head, an MTP layer beside) batched and each alone, after a prefix-cache hit and in
prefill chunks; its router held in float32 under bfloat16; the GGUFs of it llama.cpp makes (Q8_0,
Q4_K_M) against transformers on their blocks."""

from __future__ import annotations

import pytest
import torch

from freetoken.models.glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM
from freetoken.layers.sigmoid_moe import SigmoidMoeBlock, sigmoid_group_topk
from freetoken.models.registry import check_supported, load_model
from tests.model_fixtures import (HARMONY_TEXTS, assert_batch_matches_alone_and_reference,
                                  assert_family_gguf_matches_reference, assert_harmony_cache_hit_and_chunks)


@pytest.fixture(scope="module")
def glm(tiny_glm4_moe_path):
    return load_model(tiny_glm4_moe_path, dtype="float32", device="cpu")


def _hf_router(n_group: int, topk_group: int):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    torch.manual_seed(0)
    config = Glm4MoeConfig(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                           topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = Glm4MoeTopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(std=0.1)
        router.e_score_correction_bias.normal_(std=0.1)
    return router


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("n_group, topk_group", [(4, 2), (1, 1)])
def test_router_chooses_and_weighs_as_transformers_and_each_row_alone(n_group, topk_group):
    """The same experts and weights as transformers' router (its order of the k is unsorted:
    compared by expert id); the correction bias and the groups change choices here; a row's
    result is the same bits alone and in a batch of 64."""
    router = _hf_router(n_group, topk_group)
    x = torch.randn(64, 64)
    with torch.no_grad():
        logits, ref_weights, ref_ids = router(x)

    def route(rows=slice(None), correction=router.e_score_correction_bias, groups=n_group, topk_groups=topk_group):
        return sigmoid_group_topk(logits[rows], correction.detach(), 4, groups, topk_groups, True, 2.5)

    weights, ids = _by_expert(*route())
    ref_weights, ref_ids = _by_expert(ref_weights, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=0)
    assert (weights.sum(-1) - 2.5).abs().max() < 1e-5
    assert (_by_expert(*route(correction=torch.zeros(16)))[1] != ids).any(dim=-1).sum() > 8
    if n_group > 1:
        assert (_by_expert(*route(groups=1, topk_groups=1))[1] != ids).any(dim=-1).sum() > 8
    batched = route()
    for i in (0, 17, 63):
        alone = route(slice(i, i + 1))
        assert torch.equal(alone[0][0], batched[0][i]) and torch.equal(alone[1][0], batched[1][i])


def test_layers_and_fields_as_the_config_sets_them(glm):
    """A dense first layer, then sparse ones; rotary on 8 of 16 dims; q/k/v biases, no o_proj
    bias; the MTP layer (model.layers.3) not read."""
    model, cfg = glm.model, glm.model.cfg
    assert type(model) is Glm4MoeForCausalLM and cfg.num_layers == 3
    assert [type(layer.mlp) is SigmoidMoeBlock for layer in model.model.layers] == [False, True, True]
    assert (cfg.rotary_dim, cfg.qk_norm, cfg.attention_bias, cfg.o_proj_bias) == (8, True, True, False)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (4, 2, 2.5)
    assert not model.reads("model.layers.3.eh_proj.weight") and model.reads("model.layers.2.mlp.gate.weight")


@pytest.mark.parametrize("rotary", [{"partial_rotary_factor": 0.5}, {}])
def test_glm_4_5_airs_config_as_released_reads_as_transformers_5_writes_it(rotary):
    """GLM-4.5-Air's config.json (transformers 4's layout: `partial_rotary_factor` and `rope_theta`
    beside the fields, `rope_scaling` null; or no factor: transformers' default 0.5) reads as
    transformers 5's Glm4MoeConfig of it (the rotary fields nested in `rope_parameters`)."""
    from transformers import Glm4MoeConfig as HFConfig

    fields = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                  num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                  n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
                  n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, use_qk_norm=False,
                  attention_bias=True, num_nextn_predict_layers=1, max_position_embeddings=131072)
    # Where a config.json names no norm epsilon: transformers' default, 1e-5 (ModelConfig's: 1e-6).
    assert Glm4MoeConfig.from_hf({**fields, "architectures": ["Glm4MoeForCausalLM"]}).rms_norm_eps == 1e-5
    arch = {"architectures": ["Glm4MoeForCausalLM"]}
    released = {**fields, **rotary, **arch, "rope_theta": 1e6, "rope_scaling": None, "rms_norm_eps": 1e-5}
    current = {**HFConfig(**fields, **rotary, rope_parameters={"rope_theta": 1e6}).to_dict(), **arch}
    assert "partial_rotary_factor" in current["rope_parameters"]
    check_supported(released)
    cfg = Glm4MoeConfig.from_hf(released)
    assert cfg == Glm4MoeConfig.from_hf(current)
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.attention_bias, cfg.o_proj_bias, cfg.qk_norm) == (64, 1e6, True, False, False)


def test_batch_of_8_matches_transformers_and_each_alone_bit_for_bit(glm):
    assert_batch_matches_alone_and_reference(glm, HARMONY_TEXTS, alone_tol=0)


def test_prefix_hit_and_chunked_prefill_give_the_cold_result(glm):
    assert_harmony_cache_hit_and_chunks(glm)


def test_bfloat16_keeps_the_router_in_float32_as_transformers_does(tiny_glm4_moe_path):
    loaded = load_model(tiny_glm4_moe_path, dtype="bfloat16", device="cpu")
    moe = loaded.model.model.layers[1].mlp
    assert moe.gate.e_score_correction_bias.dtype == moe.gate.weight.dtype == torch.float32
    assert loaded.model.model.norm.weight.dtype == torch.bfloat16
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert moe(x).dtype == torch.bfloat16


@pytest.mark.parametrize("mix, formats", [("Q8_0", {"Q8_0", "float32"}),
                                          ("Q4_K_M", {"Q4_K", "Q6_K", "float32"})])
def test_a_glm4moe_gguf_keeps_its_blocks_and_matches_transformers_on_them(mix, formats):
    """llama.cpp's `glm4moe` file: its config built by our code from the keys (rotary on
    `rope.dimension_count` of a head, the router's groups, scale and renormalisation, the MTP
    block after the decoder's, not read), the q/k/v biases and q/k norms found by their tensors,
    the router and its correction bias (`exp_probs_b`) F32, the experts stacked; the blocks
    kept as stored, against transformers' Glm4Moe on their dequantized values."""
    loaded = assert_family_gguf_matches_reference(f"tiny-glm4moe-{mix}", formats)
    cfg = loaded.model.cfg
    assert loaded.hf_config["num_nextn_predict_layers"] == 1 and cfg.num_layers == 2
    assert (cfg.rotary_dim, cfg.head_dim, cfg.qk_norm, cfg.attention_bias, cfg.o_proj_bias) == (32, 64, True, True, False)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob) == (4, 2, 2.5, True)
    gate = loaded.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.abs().min() > 0
