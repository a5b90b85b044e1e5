"""Where the tensors of models/gguf_families.py's GGUF architectures go: their layers' GGUF
names as our HF names (models/gguf_file.py's reader reads them over its LAYER), each HF tensor's
shape, the tensors held as floats whatever the file stores, those not read as weights, and the
rows llama.cpp's converter reordered put back (gguf_families.py says what it changed).
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.layers.mla import deinterleave_rope
from freetoken.models.gguf_families import LONGROPE, Metadata

# Tensors held in float32 whatever the model's dtype: GLM's router and its correction bias, as
# transformers holds them (models/glm4_moe.py's float32_weights).
FLOAT32 = {"glm4moe": ("ffn_gate_inp", "exp_probs_b")}
# Tensors dequantized at load whatever the file stores: those, and the latent's per-head
# up-projections (per-head float Linears, layers/mla.py).
DEQUANTIZED = {"deepseek2": ("attn_kv_b", "attn_k_b", "attn_v_b"), **FLOAT32}

# Their layers' GGUF names -> HF names (gguf_file.hf_name reads them over its LAYER).
PHI3_LAYER = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_SHARED = {"ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
           "ffn_down_shexp": "mlp.shared_experts.down_proj", "exp_probs_b": "mlp.gate"}
GLM4MOE_LAYER = {"post_attention_norm": "post_attention_layernorm", **_SHARED}
# V2-Lite's attn_q is our q_b_proj over the hidden state (the llama family's q_proj is fused).
DEEPSEEK2_LAYER = {"attn_q": "self_attn.q_b_proj", "attn_q_a": "self_attn.q_a_proj",
                   "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
                   "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
                   "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.k_b_proj",
                   "attn_v_b": "self_attn.v_b_proj", **_SHARED}


def _moe_shapes(cfg, names: dict, shared: int, routed_bias: bool) -> dict:
    """`names` (a layer's attention and norms) with the dense MLP below first_k_dense_replace,
    the sparse one (router, stacked experts, `shared` experts' width of shared MLP) from there:
    every layer's HF shapes."""
    h, e, moe, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    dense = {"mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    experts = {"mlp.gate.weight": (e, h), "mlp.experts.gate_proj.weight": (e, moe, h),
               "mlp.experts.up_proj.weight": (e, moe, h), "mlp.experts.down_proj.weight": (e, h, moe),
               "mlp.shared_experts.gate_proj.weight": (shared, h), "mlp.shared_experts.up_proj.weight": (shared, h),
               "mlp.shared_experts.down_proj.weight": (h, shared)}
    if routed_bias:
        experts["mlp.gate.e_score_correction_bias"] = (e,)
    shapes = {}
    for i in range(cfg.num_layers):
        layer = names | (dense if i < cfg.first_k_dense_replace else experts)
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def glm4moe_shapes(cfg, tensors: set[str]) -> dict:
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    names = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q)}
    if cfg.attention_bias:
        names |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if cfg.qk_norm:
        names |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    return _moe_shapes(cfg, names, cfg.moe_intermediate_size * cfg.n_shared_experts, routed_bias=True)


def deepseek2_shapes(cfg, tensors: set[str]) -> dict:
    h, heads, latent, rope = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    names = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_b_proj.weight": (heads * (nope + rope), cfg.q_lora_rank or h),
             "self_attn.kv_a_proj_with_mqa.weight": (latent + rope, h), "self_attn.kv_a_layernorm.weight": (latent,),
             "self_attn.o_proj.weight": (h, heads * v)}
    if cfg.q_lora_rank:
        names |= {"self_attn.q_a_proj.weight": (cfg.q_lora_rank, h), "self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,)}
    if "blk.0.attn_k_b.weight" in tensors:  # newer converters: kv_b_proj split per head
        names |= {"self_attn.k_b_proj.weight": (heads, latent, nope), "self_attn.v_b_proj.weight": (heads, v, latent)}
    else:
        names["self_attn.kv_b_proj.weight"] = (heads * (nope + v), latent)
    return _moe_shapes(cfg, names, cfg.shared_intermediate_size, routed_bias=cfg.topk_method == "noaux_tc")


def phi3_shapes(cfg, tensors: set[str]) -> dict:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    names = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.o_proj.weight": (h, q), "mlp.gate_up_proj.weight": (2 * inter, h),
             "mlp.down_proj.weight": (h, inter)}
    if "blk.0.attn_qkv.weight" in tensors:
        names["self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
    else:
        names |= {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                  "self_attn.v_proj.weight": (kv, h)}
    return {f"model.layers.{i}.{name}": shape for i in range(cfg.num_layers) for name, shape in names.items()}


SHAPES = {"glm4moe": glm4moe_shapes, "deepseek2": deepseek2_shapes, "phi3": phi3_shapes}


def skipped(reader, arch: str) -> set[str]:
    """The file's tensors not read as weights: phi3's longrope factors (read into the config), a
    glm4moe's multi-token-prediction blocks (the last `nextn_predict_layers`)."""
    if arch == "phi3":
        return set(LONGROPE)
    if arch != "glm4moe":
        return set()
    meta = Metadata(reader, arch, "")
    first = meta.get("block_count", 0) - meta.get("nextn_predict_layers", 0)
    return {t.name for t in reader.tensors if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= first}


def rope_rows(name: str, cfg, n: int) -> np.ndarray | None:
    """deepseek2: the row order that puts a projection's interleaved rope outputs in halves
    (layers/mla.py's deinterleave_rope; the model then reads them as such), or None."""
    if name.endswith("self_attn.q_b_proj.weight"):
        width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        width = n
    else:
        return None
    return deinterleave_rope(torch.arange(n)[:, None], width, cfg.qk_rope_head_dim)[:, 0].numpy()


def join_kv_b(state: dict, cfg) -> None:
    """A newer deepseek2 file's per-head k_b ([heads, latent, nope]: transposed) and v_b ([heads,
    v, latent]) back into kv_b_proj ([heads * (nope + v), latent]), in place."""
    for name in [n for n in state if n.endswith("self_attn.k_b_proj.weight")]:
        prefix = name.removesuffix("k_b_proj.weight")
        k_b, v_b = state.pop(name), state.pop(f"{prefix}v_b_proj.weight")
        state[f"{prefix}kv_b_proj.weight"] = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, cfg.kv_lora_rank)
