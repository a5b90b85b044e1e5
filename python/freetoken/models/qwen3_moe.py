"""Qwen3-MoE (Qwen3-Coder-30B-A3B, Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (q/k
RMSNorm), and in the sparse layers a softmax top-k router over experts run grouped
(layers/moe.py).
Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) is the same with Qwen2 attention (q/k/v biases, no
q/k norm) and, beside the routed experts, a shared expert scaled by sigmoid(shared_expert_gate),
which the Qwen3.5-MoE / Qwen3-Next hybrids reuse (layers/moe.py's SparseMoeBlock).

A layer is sparse unless listed in `mlp_only_layers`, and only every `decoder_sparse_step`-th
layer is; the others keep a dense MLP of `intermediate_size`, as transformers builds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.layers.moe import SparseMoeBlock, split_stacked_experts
from freetoken.models.llama import LlamaForCausalLM, ModelConfig, fuse_hf_weights


@dataclass(frozen=True)
class Qwen3MoeConfig(ModelConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    sparse_layers: frozenset[int] = frozenset()

    @classmethod
    def from_hf(cls, cfg: dict, **extra) -> Qwen3MoeConfig:
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        sparse = frozenset(i for i in range(cfg["num_hidden_layers"])
                           if experts and i not in dense and (i + 1) % step == 0)
        return super().from_hf(cfg, num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                               moe_intermediate_size=cfg["moe_intermediate_size"],
                               norm_topk_prob=cfg.get("norm_topk_prob", False), sparse_layers=sparse,
                               shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
                               **extra)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    config_class = Qwen3MoeConfig

    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__(cfg)
        for i in cfg.sparse_layers:
            self.model.layers[i].mlp = SparseMoeBlock(
                cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)

    def convert_hf_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Checkpoints name each expert's projections (experts.{e}.gate_proj ...); transformers
        # 5 may also hold them stacked (experts.gate_up_proj [E, 2I, H], experts.down_proj).
        for stacked in ("gate_up_proj", "down_proj"):
            state = split_stacked_experts(state, stacked)
        return fuse_hf_weights(state)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2-MoE: the Qwen3-MoE decoder with Qwen2 attention and a shared expert per sparse layer
    (both read off the config by ModelConfig and Qwen3MoeConfig)."""
