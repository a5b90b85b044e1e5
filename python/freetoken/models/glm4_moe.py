"""GLM-4.5 and GLM-4.5-Air (Glm4MoeForCausalLM): the llama family's decoder (models/llama.py)
with GLM's attention and, past the first `first_k_dense_replace` dense layers, its MoE layer
(layers/sigmoid_moe.py: sigmoid router with a correction bias, group-limited, shared
experts), as transformers' Glm4Moe computes them.

- Attention: q/k/v biases with `attention_bias` (o_proj has none), per-head q/k RMSNorm with
  `use_qk_norm`, the rotary embedding on the first `partial_rotary_factor` of each head
  (transformers' default 0.5 where the config names none).
- The checkpoints' multi-token-prediction layers (`num_nextn_predict_layers`: model.layers.N
  and on, N = num_hidden_layers) are not read, as transformers does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from freetoken.config import rope_parameters
from freetoken.layers.sigmoid_moe import SigmoidMoeBlock
from freetoken.models.llama import LlamaForCausalLM, ModelConfig
from freetoken.models.qwen3_moe import Qwen3MoeForCausalLM

LAYER = re.compile(r"model\.layers\.(\d+)\.")
# transformers' Glm4MoeConfig's defaults where ModelConfig's differ, for a config that names none.
PARTIAL_ROTARY, RMS_NORM_EPS = 0.5, 1e-5


@dataclass(frozen=True)
class Glm4MoeConfig(ModelConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1

    @classmethod
    def from_hf(cls, cfg: dict, **extra) -> Glm4MoeConfig:
        factor = rope_parameters(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", PARTIAL_ROTARY))
        base = super().from_hf(
            {"rms_norm_eps": RMS_NORM_EPS, **cfg, "partial_rotary_factor": factor},
            num_experts=cfg["n_routed_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"], n_shared_experts=cfg.get("n_shared_experts", 1),
            n_group=cfg.get("n_group", 1), topk_group=cfg.get("topk_group", 1),
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
            first_k_dense_replace=cfg.get("first_k_dense_replace", 1), **extra)
        return replace(base, qk_norm=cfg.get("use_qk_norm", False), o_proj_bias=False)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    config_class = Glm4MoeConfig
    float32_weights = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")

    def __init__(self, cfg: Glm4MoeConfig):
        super().__init__(cfg)
        for layer in self.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp = SigmoidMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                                        cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                                        cfg.routed_scaling_factor, cfg.n_shared_experts)

    def reads(self, name: str) -> bool:
        layer = LAYER.match(name)
        return layer is None or int(layer[1]) < self.cfg.num_layers  # not the MTP layers

    # The experts per expert as released, or stacked as transformers 5 saves them: Qwen's layouts.
    convert_hf_weights = Qwen3MoeForCausalLM.convert_hf_weights
