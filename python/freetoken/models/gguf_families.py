"""The GGUF architectures whose config transformers' GGUF parse does not build, or builds
without what changes their results (llama.cpp's `granite`, `glm4moe`, `deepseek2`, `smollm3`:
IBM's Granite, GLM-4.5, DeepSeek-V2/V3, SmolLM3; `phi3`: Phi-3, Phi-4, Phi-4-mini, whose
longrope factors transformers' parse drops), read by our own code: the config of the HF
checkpoint llama.cpp's converter made the file from, out of its metadata (llama.cpp's keys, and
its defaults where a key is absent); where their tensors go, models/gguf_layouts.py.

Every key of the architecture's own (`{arch}.*`) is read; one that is not, or a value of one
that freetoken does not compute (a gating function, a rope without its YaRN scale, ...), is
refused by name: a file is never served as another model. What llama.cpp's converter changed:

- granite: q/k rows permuted as a llama's (undone by gguf_file's reader); its four scales as
  `embedding_scale`, `residual_scale`, `attention.scale` and `logit_scale` (an absent one is
  llama.cpp's default: 1, the attention's 1 / sqrt(head width)).
- glm4moe: the multi-token-prediction layers as blocks after the decoder's
  (`nextn_predict_layers`; not read, as transformers reads none), rotary on
  `rope.dimension_count` of each head, the router's correction bias as `exp_probs_b.bias`.
- deepseek2: V3's sigmoid routing and V2's softmax by `expert_gating_func`; one kv head (the
  latent as MQA); the heads' widths as `attention.key_length_mla` / `value_length_mla` (older
  files: `key_length` / `value_length`) and kv_b_proj whole (`attn_kv_b`) or split per head into
  `attn_k_b` (transposed) and `attn_v_b`; YaRN's mscale as `0.1 * mscale_all_dim`
  (`rope.scaling.yarn_log_multiplier`), the only one llama.cpp computes (transformers'
  `mscale` taken equal to it); the rope dimensions interleaved as released.
- phi3: q/k/v fused as `attn_qkv` (or apart: llama.cpp reads either), gate/up as `ffn_up`
  ([gate | up] rows), as the checkpoint stores them; longrope's factors as the tensors
  `rope_factors_long` / `rope_factors_short` (one per rotary frequency) with
  `rope.scaling.attn_factor` (cos and sin's scale; llama.cpp's default 1) and
  `rope.scaling.original_context_length`; rotary on `rope.dimension_count` of each head
  (Phi-4-mini's 3/4); `attention.sliding_window` 0 for none (Phi-4). transformers' Phi-3 slides
  in its window, as served here; llama.cpp turns Phi's window off.
- smollm3: q/k rows permuted as a llama's; no key for its layers without rotary embedding:
  llama.cpp's rule, every 4th (`n_no_rope_layer_step`), transformers' default interval.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from freetoken.paths import ModelNotFound

# llama.cpp writes longrope's factors as tensors (one set each, shared by every layer).
LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")

SIGMOID, SOFTMAX = 2, 1  # llama.cpp's expert_gating_func values


class Metadata:
    """The `{arch}.*` keys of a file, each read at most through `get`; `unread` names the rest."""

    def __init__(self, reader, arch: str, name: str):
        self.fields, self.arch, self.name = reader.fields, arch, name
        self.read: set[str] = set()

    def get(self, key: str, default=None):
        full = f"{self.arch}.{key}"
        self.read.add(full)
        field = self.fields.get(full)
        if field is None:
            return default
        if field.types[0] == GGUFValueType.ARRAY:
            raise self.refused(f"{full} (a value per layer)")
        if field.types[0] == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode()
        return field.parts[field.data[0]].tolist()[0]

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelNotFound(f"{self.name}: a {self.arch} GGUF without {self.arch}.{key}")
        return value

    def refused(self, what: str) -> ModelNotFound:
        return ModelNotFound(f"{self.name}: {what} is not supported: freetoken's {self.arch} does not "
                             "compute it and would serve another model")

    def check_all_read(self) -> None:
        unread = sorted(k for k in self.fields if k.startswith(f"{self.arch}.") and k not in self.read)
        if unread:
            raise self.refused(", ".join(f"{k}={self.get(k.removeprefix(self.arch + '.'))!r}" for k in unread))


def _dense(meta: Metadata, tensors: dict, head_dim: int | None = None) -> dict:
    """The fields of every decoder: sizes, norm epsilon, context, rotary base and schedule, tied head."""
    hidden, heads = meta.need("embedding_length"), meta.need("attention.head_count")
    config = {"hidden_size": hidden, "num_attention_heads": heads, "num_hidden_layers": meta.need("block_count"),
              "num_key_value_heads": meta.get("attention.head_count_kv", heads),
              "intermediate_size": meta.need("feed_forward_length"),
              "max_position_embeddings": meta.need("context_length"),
              "rms_norm_eps": meta.need("attention.layer_norm_rms_epsilon"),
              "tie_word_embeddings": "output.weight" not in tensors}
    if head_dim is None:
        head_dim = meta.get("attention.key_length", hidden // heads)
        if meta.get("attention.value_length", head_dim) != head_dim:
            raise meta.refused(f"{meta.arch}.attention.value_length != key_length")
    config["head_dim"] = head_dim
    rope = {"rope_type": "default", "rope_theta": meta.get("rope.freq_base", 10000.0)}
    scaling = meta.get("rope.scaling.type", "none")
    if scaling != "none":  # a type its family lacks is refused by registry.check_supported, named
        rope |= {"rope_type": scaling, "factor": meta.need("rope.scaling.factor")}
    if scaling == "yarn":
        rope["original_max_position_embeddings"] = meta.need("rope.scaling.original_context_length")
        rope |= {name: value for name in ("beta_fast", "beta_slow")
                 if (value := meta.get(f"rope.scaling.yarn_{name}")) is not None}
    config["rope_parameters"] = rope
    return config


def _whole_rotary(meta: Metadata, head_dim: int) -> None:
    if (rotary := meta.get("rope.dimension_count", head_dim)) != head_dim:
        raise meta.refused(f"{meta.arch}.rope.dimension_count={rotary} (rotary on part of each head)")


def granite_config(meta: Metadata, tensors: dict) -> dict:
    config = _dense(meta, tensors)
    head_dim = config["head_dim"]
    _whole_rotary(meta, head_dim)
    if not meta.get("rope.scaling.finetuned", True):  # llama.cpp's switch turning rope off
        raise meta.refused("granite.rope.scaling.finetuned=False (no rotary embedding)")
    return config | {"architectures": ["GraniteForCausalLM"], "model_type": "granite",
                     "embedding_multiplier": meta.get("embedding_scale") or 1.0,
                     "residual_multiplier": meta.get("residual_scale") or 1.0,
                     "attention_multiplier": meta.get("attention.scale") or head_dim ** -0.5,
                     "logits_scaling": meta.get("logit_scale") or 1.0}


def smollm3_config(meta: Metadata, tensors: dict) -> dict:
    config = _dense(meta, tensors)
    _whole_rotary(meta, config["head_dim"])
    return config | {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "no_rope_layer_interval": 4}


def phi3_config(meta: Metadata, tensors: dict) -> dict:
    config = _dense(meta, tensors)
    rotary = meta.get("rope.dimension_count", config["head_dim"])
    original = meta.get("rope.scaling.original_context_length", config["max_position_embeddings"])
    rope, scale = config["rope_parameters"], meta.get("rope.scaling.attn_factor", 1.0)
    factors = {name: _factors(meta, tensors[name], rotary) for name in LONGROPE if name in tensors}
    if factors:
        if len(factors) == 1:
            raise meta.refused(f"longrope with {', '.join(factors)} alone")
        long, short = factors.values()
        rope |= {"rope_type": "longrope", "long_factor": long, "short_factor": short, "attention_factor": scale,
                 "original_max_position_embeddings": original}
    elif scale != 1:
        raise meta.refused(f"phi3.rope.scaling.attn_factor={scale} without longrope's factors")
    return config | {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                     "original_max_position_embeddings": original, "partial_rotary_factor": rotary / config["head_dim"],
                     "sliding_window": meta.get("attention.sliding_window") or None}


def _factors(meta: Metadata, tensor, rotary: int) -> list[float]:
    """A longrope factor tensor's values: one per rotary frequency."""
    if tensor.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or tensor.n_elements != rotary // 2:
        raise meta.refused(f"{tensor.name} of {tensor.n_elements} {tensor.tensor_type.name} values "
                           f"(longrope's factors: {rotary // 2} floats, one per rotary frequency)")
    return np.asarray(tensor.data, dtype=np.float32).tolist()


def _experts(meta: Metadata) -> dict:
    """The routed and shared experts' fields (llama.cpp's defaults: no groups, not renormalised)."""
    return {"n_routed_experts": meta.need("expert_count"), "num_experts_per_tok": meta.need("expert_used_count"),
            "moe_intermediate_size": meta.need("expert_feed_forward_length"),
            "n_shared_experts": meta.get("expert_shared_count", 0),
            "first_k_dense_replace": meta.get("leading_dense_block_count", 0),
            "routed_scaling_factor": meta.get("expert_weights_scale", 1.0),
            "norm_topk_prob": bool(meta.get("expert_weights_norm", False)),
            "n_group": meta.get("expert_group_count", 1), "topk_group": meta.get("expert_group_used_count", 1)}


def glm4moe_config(meta: Metadata, tensors: dict) -> dict:
    config = _dense(meta, tensors) | _experts(meta)
    if (gating := meta.get("expert_gating_func", SIGMOID)) != SIGMOID:
        raise meta.refused(f"glm4moe.expert_gating_func={gating} (GLM-4.5 routes by sigmoid, 2)")
    mtp = meta.get("nextn_predict_layers", 0)
    rotary = meta.need("rope.dimension_count")
    return config | {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
                     "num_hidden_layers": config["num_hidden_layers"] - mtp, "num_nextn_predict_layers": mtp,
                     "partial_rotary_factor": rotary / config["head_dim"],
                     "attention_bias": "blk.0.attn_q.bias" in tensors,
                     "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors}


def deepseek2_config(meta: Metadata, tensors: dict) -> dict:
    rope_dim, latent = meta.need("rope.dimension_count"), meta.need("attention.kv_lora_rank")
    heads = meta.need("attention.head_count")
    key, value = meta.need("attention.key_length"), meta.need("attention.value_length")
    if meta.get("attention.key_length_mla") is not None:  # key/value_length then the latent's
        key, value = meta.need("attention.key_length_mla"), meta.need("attention.value_length_mla")
    config = _dense(meta, tensors, head_dim=rope_dim) | _experts(meta)
    rope = config["rope_parameters"]
    if rope["rope_type"] == "yarn":
        if not (log_mul := meta.get("rope.scaling.yarn_log_multiplier")):
            raise meta.refused("deepseek2's YaRN without rope.scaling.yarn_log_multiplier (mscale_all_dim)")
        rope |= {"mscale": log_mul / 0.1, "mscale_all_dim": log_mul / 0.1}
    gating = meta.get("expert_gating_func", SOFTMAX)  # llama.cpp's default: V2's files name none
    if gating not in (SIGMOID, SOFTMAX):
        raise meta.refused(f"deepseek2.expert_gating_func={gating}")
    if gating == SOFTMAX and config["norm_topk_prob"]:
        raise meta.refused("deepseek2.expert_weights_norm=True under softmax routing (V2 does not renormalise)")
    v3 = gating == SIGMOID
    return config | {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2", "num_key_value_heads": heads,
        "q_lora_rank": meta.get("attention.q_lora_rank"), "kv_lora_rank": latent,
        "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": key - rope_dim, "v_head_dim": value,
        "rope_interleave": True, "scoring_func": "sigmoid" if v3 else "softmax",
        # V2's groups: the best experts' (transformers' group_limited_greedy).
        "topk_method": "noaux_tc" if v3 else "group_limited_greedy" if config["n_group"] > 1 else "greedy"}


CONFIGS = {"granite": granite_config, "glm4moe": glm4moe_config, "deepseek2": deepseek2_config,
           "phi3": phi3_config, "smollm3": smollm3_config}


def config_from_metadata(reader, arch: str, name: str) -> dict:
    """The HF config of a file of one of CONFIGS' architectures (a ModelNotFound naming the key
    or value freetoken does not compute). Each of CONFIGS is given the file's tensors by name."""
    meta = Metadata(reader, arch, name)
    config = CONFIGS[arch](meta, {t.name: t for t in reader.tensors})
    # The embedding's rows where the key is absent (gguf_file's shapes check the two agree).
    rows = [int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight"]
    config["vocab_size"] = meta.get("vocab_size") or (rows or [0])[0]
    meta.check_all_read()
    return config
