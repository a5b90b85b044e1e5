"""The architecture table's refusals: what freetoken would not compute as transformers does is
refused by name, in one line, before anything is converted or loaded."""

from __future__ import annotations

import pytest

from freetoken.models import loader, registry
from freetoken.models.registry import SERVED, check_supported
from freetoken.paths import ModelNotFound

# Each served architecture's transformers config (model_type).
MODEL_TYPES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite", "Phi3ForCausalLM": "phi3", "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe", "GptOssForCausalLM": "gpt_oss", "Glm4MoeForCausalLM": "glm4_moe",
    "Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next", "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
}  # fmt: skip


def hf_config(arch: str, **fields) -> dict:
    """transformers' default config of the architecture's model type, as config.json holds it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return {**CONFIG_MAPPING[MODEL_TYPES[arch]]().to_dict(), "architectures": [arch], **fields}


def test_every_served_architecture_passes_with_transformers_defaults():
    """Including gpt-oss's and Mistral's windows and the hybrids' linear-attention layers and
    partial rotary: the quirks their families implement."""
    assert set(MODEL_TYPES) == set(SERVED)
    for arch in SERVED:
        check_supported(hf_config(arch))


def test_an_unknown_architecture_names_the_served_ones_but_not_the_test_model():
    with pytest.raises(ModelNotFound) as refused:
        check_supported({"architectures": ["Gemma2ForCausalLM"]})
    message = str(refused.value)
    assert message.startswith("architecture Gemma2ForCausalLM is not supported; freetoken serves ")
    assert all(arch in message for arch in SERVED) and "Scripted" not in message
    assert "\n" not in message
    check_supported({"architectures": ["ScriptedForCausalLM"], "vocab_size": 8})  # still loadable


@pytest.mark.parametrize(("arch", "fields", "named"), [
    ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "dynamic", "factor": 8.0}}, "rope_type 'dynamic'"),
    ("Qwen3_5ForCausalLM", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3'"),
    # transformers' Phi-3 reads a yarn schedule as longrope
    ("Phi3ForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    # as transformers 4 wrote it
    ("LlamaForCausalLM", {"rope_parameters": None, "rope_scaling": {"type": "longrope"}}, "rope_type 'longrope'"),
    ("Qwen3_5ForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    # transformers' Llama ignores a window; a Qwen3 (below) honours it.
    ("LlamaForCausalLM", {"sliding_window": 512}, "sliding_window=512"),
    ("LlamaForCausalLM", {"no_rope_layers": [1, 1, 1, 0]}, "no_rope_layers=.1, 1, 1, 0."),
    ("LlamaForCausalLM", {"embedding_multiplier": 12.0, "logits_scaling": 8.0},
     "embedding_multiplier=12.0, logits_scaling=8.0"),
    ("Qwen3ForCausalLM", {"attention_multiplier": 0.0078125}, "attention_multiplier=0.0078125"),
    ("Qwen3ForCausalLM", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh'"),
    ("LlamaForCausalLM", {"mlp_bias": True}, "mlp_bias=True"),
    ("LlamaForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("Qwen3ForCausalLM", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor=0.25"),
    ("Qwen3ForCausalLM", {"layer_types": ["full_attention", "linear_attention"]}, r"layer_types=\['linear_attention'\]"),
    ("GptOssForCausalLM", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    # Gemma 3's releases set neither soft cap (Gemma 2's did), nor a GeGLU of another GELU
    ("Gemma3ForCausalLM", {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
     "attn_logit_softcapping=50.0, final_logit_softcapping=30.0"),
    ("Gemma3ForCausalLM", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("Qwen3ForCausalLM", {"query_pre_attn_scalar": 144}, "query_pre_attn_scalar=144"),
    # GLM-4.5's router's fields on another MoE family
    ("Qwen3MoeForCausalLM", {"routed_scaling_factor": 2.5, "n_group": 8}, "routed_scaling_factor=2.5, n_group=8"),
    # each layer type's schedule, transformers 5's nesting; as released: the global layers'
    ("Gemma3ForCausalLM", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
     "rope_type 'yarn'"),
    ("Gemma3ForCausalLM", {"rope_parameters": None, "rope_scaling": {"rope_type": "dynamic", "factor": 8.0}},
     "rope_type 'dynamic'"),
    # DeepSeek's own code makes every moe_layer_freq-th layer sparse, transformers every one
    ("DeepseekV2ForCausalLM", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("DeepseekV3ForCausalLM", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3'"),
])  # fmt: skip
def test_a_field_the_family_would_ignore_is_refused_by_name(arch, fields, named):
    with pytest.raises(ModelNotFound, match=f"^{arch} with {named}") as refused:
        check_supported(hf_config(arch, **fields))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("arch", "fields"), [
    ("Qwen3ForCausalLM", {"sliding_window": 512, "use_sliding_window": True}),
    ("Qwen3ForCausalLM", {"sliding_window": 4096, "use_sliding_window": False}),  # Qwen's releases
    ("LlamaForCausalLM", {"sliding_window": 2048, "max_position_embeddings": 2048}),  # never binds
    ("LlamaForCausalLM", {"sliding_window": None, "hidden_act": "silu", "mlp_bias": False}),
    ("LlamaForCausalLM", {"rope_parameters": None,
                          "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
    # DeepSeek-V3's, as released (rope_scaling's yarn with mscale), its moe_layer_freq
    ("DeepseekV3ForCausalLM", {"rope_parameters": None, "moe_layer_freq": 1, "rope_scaling": {
        "type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1}}),
])  # fmt: skip
def test_fields_set_as_the_family_computes_them_pass(arch, fields):
    check_supported(hf_config(arch, **fields))


def test_a_gguf_of_an_unserved_architecture_is_refused_before_it_is_converted(tmp_path, monkeypatch):
    """transformers reads a gemma2 file's config; the refusal comes before its conversion to a
    float32 folder (the weights' load)."""
    from tests.fixtures import build_models as bm

    def converted(*args):
        raise AssertionError("converted before the refusal")

    monkeypatch.setattr(loader, "gguf_to_folder", converted)
    path = bm.build_config_only_gguf(tmp_path, "gemma2") / "model.gguf"
    with pytest.raises(ModelNotFound, match="^architecture Gemma2ForCausalLM is not supported"):
        registry.load_model(path)
