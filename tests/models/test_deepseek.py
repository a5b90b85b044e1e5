"""DeepSeek-V3 and V2 (models/deepseek.py, layers/mla.py) against transformers on the same
weights: the tiny DeepseekV3ForCausalLM (latent ranks below the hidden size, queries through a
rank, interleaved rope under YaRN with mscale, a dense first layer, then sigmoid routing in
groups with a correction bias and a shared expert) batched and each alone bit for bit, after a
prefix-cache hit and in prefill chunks, on the pool kernel and on torch's SDPA; its KV pool holding
a latent and a rope key per token; the tiny DeepseekV2ForCausalLM (V2-Lite's plain q_proj, V2's
group-limited softmax routing); the GGUFs llama.cpp makes of each (V2-Lite's shape in Q8_0, V3's in
Q4_K_M) against transformers on their blocks."""

from __future__ import annotations

import pytest

from freetoken.layers.mla import HeadLinears
from freetoken.layers.quantized import QuantizedLinear
from freetoken.models.registry import load_model
from freetoken.paths import ModelNotFound
from freetoken.scheduler.factory import build_scheduler
from tests.fixtures import build_models as bm
from tests.model_fixtures import (HARMONY_TEXTS, assert_batch_matches_alone_and_reference,
                                  assert_family_gguf_matches_reference, assert_harmony_cache_hit_and_chunks,
                                  assert_matches_reference, greedy_run)


@pytest.fixture(scope="module")
def deepseek(tiny_deepseek_v3_path):
    return load_model(tiny_deepseek_v3_path, dtype="float32", device="cpu")


def test_the_pool_holds_each_tokens_latent_and_rope_key_not_its_heads(deepseek):
    """A layer's entry per token is kv_lora_rank + qk_rope_head_dim wide (48 here), where
    per-head keys and values would take heads * (qk_nope + qk_rope + v_head) (4 * 48): the
    pool's bytes per token are layers * 48 * 4."""
    cfg = deepseek.model.cfg
    scheduler = build_scheduler(deepseek, kv_slots=64)
    pool = scheduler.engine.kv.kv
    assert len(pool) == cfg.num_layers == 3 and all(layer.shape == (65, 1, 48) for layer in pool)
    per_token = sum(layer[0].nbytes for layer in pool)
    assert per_token == cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 == 576
    per_head = cfg.num_layers * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 4
    assert per_head == 4 * per_token
    # The quirks are on, the layers in Python, the heads' projections on the grouped kernel.
    layers = deepseek.model.model.layers
    assert cfg.q_lora_rank == 48 < cfg.hidden_size and cfg.kv_lora_rank == 32 < cfg.hidden_size
    assert layers[1].mlp.e_score_correction_bias.abs().min() > 0 and not hasattr(layers[0].mlp, "gate")
    assert cfg.rope_scaling.attention_factor != 1 and cfg.attention_scale != 32 ** -0.5
    assert all(layer.self_attn.pool for layer in layers)
    assert deepseek.model.kernel_plan.ops["attention"] == "pool_attention.c (f32 pool)"
    assert all(m.packed is not None for m in deepseek.model.modules() if isinstance(m, HeadLinears))
    greedy_run(scheduler, {0: deepseek.tokenizer.encode("Hi")}, steps=1)
    assert all(layer.prepared_call() is None for layer in layers) and deepseek.model.model.stack is None


def test_batch_of_8_matches_transformers_and_each_alone_bit_for_bit(deepseek):
    assert_batch_matches_alone_and_reference(deepseek, HARMONY_TEXTS, alone_tol=0.0)


def test_prefix_hit_and_chunked_prefill_give_the_cold_result(deepseek):
    assert_harmony_cache_hit_and_chunks(deepseek)


def test_torchs_sdpa_over_the_gathered_latents_matches_too(deepseek, monkeypatch):
    """Where the pool kernel cannot run, SDPA over the gathered rows (keys and values the whole
    row, the latent part kept): transformers' result, alone and batched alike."""
    for layer in deepseek.model.model.layers:  # as the plan leaves a layer the kernel cannot read
        monkeypatch.setattr(layer.self_attn, "pool", False)
    prompts = {uid: deepseek.tokenizer.encode(text) for uid, text in enumerate(HARMONY_TEXTS[:3])}
    together, _ = greedy_run(build_scheduler(deepseek, kv_slots=256, prefix_cache=False), prompts, steps=6)
    alone, _ = greedy_run(build_scheduler(deepseek, kv_slots=256, prefix_cache=False), {2: prompts[2]}, steps=6)
    assert together[2] == alone[2]
    for uid, ids in prompts.items():
        assert_matches_reference(deepseek.folder, ids, together[uid])


def test_deepseek_v2_lite_shape_matches_transformers_batched_and_alone():
    folder = bm.cached("tiny-deepseek-v2", bm.build_tiny_deepseek_v2)
    loaded = load_model(folder, dtype="float32", device="cpu")
    cfg = loaded.model.cfg
    assert cfg.q_lora_rank is None and cfg.topk_method == "group_limited_greedy" and not cfg.norm_topk_prob
    assert_batch_matches_alone_and_reference(loaded, HARMONY_TEXTS[:3], alone_tol=0.0)


@pytest.mark.parametrize("mix, arch, formats", [
    ("Q8_0", "DeepseekV2ForCausalLM", {"Q8_0", "float32"}),
    ("Q4_K_M", "DeepseekV3ForCausalLM", {"Q4_K", "Q6_K", "Q8_0", "float32"})])
def test_a_deepseek2_gguf_keeps_its_blocks_and_matches_transformers_on_them(mix, arch, formats):
    """llama.cpp's `deepseek2` files: V2-Lite's shape in Q8_0 (a plain attn_q, kv_b whole, no
    gating key: softmax, in groups), V3's in Q4_K_M (a query rank, sigmoid routing with
    `exp_probs_b`, kv_b split per head into attn_k_b / attn_v_b as newer converters write it);
    the ranks, head widths and YaRN's mscale from the keys; the interleaved rope rows of the
    kept blocks put in halves; against transformers' DeepSeek on the dequantized values."""
    loaded = assert_family_gguf_matches_reference(f"tiny-deepseek2-{mix}", formats)
    cfg = loaded.model.cfg
    assert type(loaded.model).__name__ == arch and cfg.kv_lora_rank == 128 < cfg.hidden_size
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_row) == (32, 32, 64, (1, 160))
    assert cfg.rope_scaling.factor == 4 and cfg.attention_scale != 64 ** -0.5
    assert cfg.topk_method == ("noaux_tc" if mix == "Q4_K_M" else "group_limited_greedy")
    assert cfg.q_lora_rank == (128 if mix == "Q4_K_M" else None)
    attention = loaded.model.model.layers[1].self_attn
    assert isinstance(attention.q_b_proj, QuantizedLinear) and isinstance(attention.kv_a_proj_with_mqa, QuantizedLinear)


def test_tensor_parallelism_is_refused_saying_why(tiny_deepseek_v3_path):
    class Rank:  # distributed.group.Group's interface, never reached
        pass

    with pytest.raises(ModelNotFound, match="^DeepseekV3ForCausalLM: tensor parallelism is not implemented for "
                                            "multi-head latent attention"):
        load_model(tiny_deepseek_v3_path, device="cpu", group=Rank())
