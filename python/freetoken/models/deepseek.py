"""DeepSeek-V3 / R1 (DeepseekV3ForCausalLM) and DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM):
the llama family's decoder (models/llama.py) with multi-head latent attention
(layers/mla.py: the KV pool holds each token's compressed latent and rope key) and, from
layer `first_k_dense_replace` on, mixture-of-experts layers with shared experts, as transformers'
DeepSeek classes compute them.

- Queries through a low-rank pair (`q_a_proj`, `q_a_layernorm`, `q_b_proj`) where the config sets
  `q_lora_rank` (V2-Lite: none, one `q_proj`).
- Scores scaled by 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times mscale(factor,
  mscale_all_dim)^2 under YaRN (transformers' `yarn_apply_mscale`); YaRN's cos and sin scaled by
  mscale(factor, mscale) / mscale(factor, mscale_all_dim) (layers/rotary.py).
- Routers in float32 over the gate's logits, each token's k weights times
  `routed_scaling_factor`: V3's sigmoid scores, experts chosen on scores plus
  `e_score_correction_bias` within the `topk_group` groups (of `n_group`) whose two best such
  scores sum highest, weighted by the plain scores (renormalised with `norm_topk_prob`); V2's
  softmax, `greedy` or `group_limited_greedy` (the groups with the best single score; the
  others' scores zeroed), not renormalised (transformers' V2 reads no `norm_topk_prob`).
- Beside the routed experts, `n_shared_experts` experts' worth of SwiGLU every token goes through.

The decoder layer's C call (kernels/decoder_layer.py) computes the llama layer: DeepSeek's
layers always run in Python. Tensor parallelism is refused (the registry's row says why).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from freetoken.config import rope_parameters, rope_type
from freetoken.layers.elementwise import silu_and_mul
from freetoken.layers.linear import Linear
from freetoken.layers.mla import LatentAttention, deinterleave_rope, split_kv_b
from freetoken.layers.mlp import MLP
from freetoken.layers.moe import Experts, split_stacked_experts
from freetoken.layers.rotary import yarn_mscale
from freetoken.layers.sigmoid_moe import best_groups, sigmoid_group_topk
from freetoken.models.llama import DecoderLayer, LlamaForCausalLM, ModelConfig, fuse_hf_weights

V3 = "DeepseekV3ForCausalLM"
LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class DeepseekConfig(ModelConfig):
    # Attention: ModelConfig's num_kv_heads (1) and head_dim (kv_lora_rank + qk_rope_head_dim) are
    # those of the absorbed attention, one kv head of the latent and the rope key; rotary_dim is
    # qk_rope_head_dim.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleaved: bool = True  # the checkpoint's rope dimensions paired (x0, x1), (x2, x3), ...
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    topk_method: str = "noaux_tc"  # V3's; V2's "greedy" or "group_limited_greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    @property
    def kv_row(self) -> tuple[int, int]:
        """A token's entry in a layer of the KV pool (kvcache/kv_pool.py): [latent | rope key]."""
        return 1, self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, cfg: dict, **extra) -> DeepseekConfig:
        v3 = (cfg.get("architectures") or [V3])[0] == V3
        nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        scale = (nope + rope) ** -0.5  # transformers' yarn_apply_mscale, in its order
        parameters = rope_parameters(cfg)
        if rope_type(parameters) != "default" and parameters.get("mscale_all_dim"):
            mscale = yarn_mscale(parameters["factor"], parameters["mscale_all_dim"])
            scale = scale * mscale * mscale
        expert = cfg["moe_intermediate_size"]
        base = super().from_hf({**cfg, "head_dim": rope}, q_lora_rank=cfg.get("q_lora_rank"),
                               kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                               v_head_dim=cfg["v_head_dim"],
                               rope_interleaved=cfg.get("rope_interleave", True) if v3 else True,
                               num_experts=cfg.get("n_routed_experts") or 0,
                               num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
                               moe_intermediate_size=expert,
                               shared_intermediate_size=expert * (cfg.get("n_shared_experts") or 0),
                               first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
                               topk_method="noaux_tc" if v3 else cfg.get("topk_method") or "greedy",
                               n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
                               norm_topk_prob=v3 and bool(cfg.get("norm_topk_prob")),
                               routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0), **extra)
        return replace(base, num_kv_heads=1, head_dim=cfg["kv_lora_rank"] + rope, rotary_dim=rope,
                       attention_scale=scale)


def softmax_greedy(logits: torch.Tensor, cfg: DeepseekConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """V2's routing: softmax scores, the k best (of the best groups' experts: group_limited_greedy)."""
    scores = logits.softmax(dim=-1)
    if cfg.topk_method == "group_limited_greedy":
        groups = scores.view(scores.shape[0], cfg.n_group, -1).max(dim=-1).values
        scores = scores.masked_fill(~best_groups(groups, cfg.topk_group, scores.shape[1]), 0.0)
    weights, ids = scores.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)
    return weights * cfg.routed_scaling_factor, ids


class DeepseekMoE(Experts):
    """The router (`gate`, V3's `e_score_correction_bias`), the routed experts and the shared ones."""

    def __init__(self, cfg: DeepseekConfig):
        super().__init__(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, bias=False,
                         activation=silu_and_mul)
        self.cfg = cfg
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = torch.nn.Parameter(torch.zeros(cfg.num_experts))
        self.shared_experts = MLP(cfg.hidden_size, cfg.shared_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).float()
        if self.cfg.topk_method == "noaux_tc":
            cfg = self.cfg
            weights, ids = sigmoid_group_topk(logits, self.e_score_correction_bias, cfg.num_experts_per_tok,
                                              cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                                              cfg.routed_scaling_factor)
        else:
            weights, ids = softmax_greedy(logits, self.cfg)
        return super().forward(x, ids, weights) + self.shared_experts(x)


class DeepseekDecoderLayer(DecoderLayer):
    one_call = None  # always in Python: the C layer is the llama one

    def __init__(self, cfg: DeepseekConfig, layer: int):
        super().__init__(cfg, layer)
        self.self_attn = LatentAttention(cfg, layer)
        if layer >= cfg.first_k_dense_replace:
            self.mlp = DeepseekMoE(cfg)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    config_class = DeepseekConfig
    layer_class = DeepseekDecoderLayer

    def reads(self, name: str) -> bool:
        # V3's checkpoints hold its multi-token-prediction layer after the last (transformers
        # skips it too).
        layer = LAYER.match(name)
        return layer is None or int(layer.group(1)) < self.cfg.num_layers

    def convert_hf_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        for stacked in ("gate_up_proj", "down_proj"):  # transformers 5's layout of the experts
            state = split_stacked_experts(state, stacked)
        q_width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        for i in range(cfg.num_layers):
            prefix = f"model.layers.{i}."
            attn = f"{prefix}self_attn."
            split_kv_b(state, attn, cfg.num_heads, cfg.qk_nope_head_dim)
            if f"{attn}q_proj.weight" in state:
                state[f"{attn}q_b_proj.weight"] = state.pop(f"{attn}q_proj.weight")
            if cfg.rope_interleaved:
                name = f"{attn}q_b_proj.weight"
                state[name] = deinterleave_rope(state[name], q_width, cfg.qk_rope_head_dim)
                for name in (f"{attn}kv_a_proj_with_mqa.weight", f"{attn}kv_a_proj_with_mqa.bias"):
                    if name in state:
                        state[name] = deinterleave_rope(state[name], state[name].shape[0], cfg.qk_rope_head_dim)
            bias = state.pop(f"{prefix}mlp.gate.e_score_correction_bias", None)
            if bias is not None:
                state[f"{prefix}mlp.e_score_correction_bias"] = bias
        return fuse_hf_weights(state)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2: V3's decoder with V2's softmax router and rope always interleaved (both read
    off the config by DeepseekConfig)."""
