"""Qwen3-MoE (Qwen3-Coder-30B-A3B, Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (q/k
RMSNorm), and in the sparse layers a softmax top-k router over experts run grouped (models/moe.py).
Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) is the same with Qwen2 attention (q/k/v biases, no
q/k norm) and, beside the routed experts, a shared expert scaled by sigmoid(shared_expert_gate),
which the Qwen3.5-MoE / Qwen3-Next hybrids reuse (models/qwen3_5.py).

A layer is sparse unless listed in `mlp_only_layers`, and only every `decoder_sparse_step`-th
layer is; the others keep a dense MLP of `intermediate_size`, as transformers builds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.models.elementwise import lanewise
from freetoken.models.linear import Linear
from freetoken.models.llama import MLP, LlamaForCausalLM, ModelConfig, fuse_hf_weights
from freetoken.models.moe import Experts, silu_and_mul, softmax_topk, split_stacked_experts


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


@dataclass(frozen=True)
class _MLPShape:  # what llama.MLP reads of a config
    hidden_size: int
    intermediate_size: int


class SparseMoeBlock(Experts):
    """The router (`gate`) and the experts of one layer, named as transformers names them; with
    `shared_intermediate`, also a shared expert every token goes through, scaled by
    sigmoid(shared_expert_gate)."""

    def __init__(self, hidden: int, num_experts: int, intermediate: int, top_k: int,
                 norm_topk_prob: bool, shared_intermediate: int = 0):
        super().__init__(num_experts, hidden, intermediate, bias=False, activation=silu_and_mul)
        self.gate = Linear(hidden, num_experts, bias=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        if shared_intermediate:
            self.shared_expert = MLP(_MLPShape(hidden, shared_intermediate))
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    @classmethod
    def from_config(cls, cfg: Qwen3MoeConfig) -> SparseMoeBlock:
        return cls(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                   cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x), self.top_k, self.norm_topk_prob)
        routed = super().forward(x, ids, weights)
        if not hasattr(self, "shared_expert"):
            return routed
        # One gate per token ([T, 1]): lanewise, or a token's gate would depend on T.
        return routed + lanewise(torch.sigmoid, self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    config_class = Qwen3MoeConfig

    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__(cfg)
        for i in cfg.sparse_layers:
            self.model.layers[i].mlp = SparseMoeBlock.from_config(cfg)

    @staticmethod
    def convert_hf_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Checkpoints name each expert's projections (experts.{e}.gate_proj ...); transformers
        # 5 may also hold them stacked (experts.gate_up_proj [E, 2I, H], experts.down_proj).
        for stacked in ("gate_up_proj", "down_proj"):
            state = split_stacked_experts(state, stacked)
        return fuse_hf_weights(state)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2-MoE: the Qwen3-MoE decoder with Qwen2 attention and a shared expert per sparse layer
    (both read off the config by llama.ModelConfig and Qwen3MoeConfig)."""
