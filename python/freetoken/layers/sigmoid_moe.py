"""The MoE layer of GLM-4.5 (and of DeepSeek-V3, whose layer GLM-4.5's is): a sigmoid router
whose scores, plus a per-expert correction bias, choose the experts, and shared experts every
token goes through; the routed experts run grouped as the Qwen MoE families' do (moe.py's
`Experts`: a token's weighted sum in ascending expert id, whatever its batch).

Routing, as transformers' Glm4MoeTopkRouter computes it, in float32:
- scores = sigmoid(router logits); the choice ranks scores + `e_score_correction_bias`;
- group-limited: the experts fall in `n_group` equal groups, each group ranked by the sum of
  its two best corrected scores, and only the `topk_group` best groups' experts may be chosen;
- the k best remaining experts are weighted by their uncorrected scores, renormalised to sum to
  1 with `norm_topk_prob`, then scaled by `routed_scaling_factor`.
transformers keeps the router's weight and bias in float32 whatever the model's dtype: so does
the family (CausalLM.float32_weights), the router's input widened to float32.
"""

from __future__ import annotations

import torch

from freetoken.layers.elementwise import lanewise, silu_and_mul
from freetoken.layers.linear import Linear
from freetoken.layers.mlp import MLP
from freetoken.layers.moe import Experts


def sigmoid_group_topk(logits: torch.Tensor, correction: torch.Tensor, k: int, groups: int, topk_groups: int,
                       normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) of router logits [T, E] (the routing above).
    Every op is a row's own: a row's choice and weights do not depend on its batch."""
    # One score per (token, expert), an experts' width that need not fill torch's vectors: lanewise.
    scores = lanewise(torch.sigmoid, logits.float())
    choice = scores + correction.float()
    if groups > 1:
        best_two = choice.view(choice.shape[0], groups, -1).topk(2, dim=-1).values.sum(dim=-1)
        choice = choice.masked_fill(~best_groups(best_two, topk_groups, choice.shape[1]), float("-inf"))
    ids = torch.topk(choice, k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # transformers' epsilon
    return weights * scale, ids


def best_groups(group_scores: torch.Tensor, k: int, experts: int) -> torch.Tensor:
    """bool [T, experts]: the experts of each token's k best groups (`group_scores` [T, groups])."""
    best = group_scores.topk(k, dim=-1, sorted=False).indices
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return chosen.repeat_interleave(experts // group_scores.shape[1], dim=1)


class Router(Linear):
    """The router's projection (`gate.weight`) and its choice's correction (`gate.e_score_correction_bias`)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__(hidden, num_experts, bias=False)
        self.e_score_correction_bias = torch.nn.Parameter(torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.e_score_correction_bias.dtype))


class SigmoidMoeBlock(Experts):
    """The router (`gate`), the routed experts and the shared experts (`shared_experts`, one MLP
    of n_shared_experts * moe_intermediate_size) of one layer, named as transformers names them."""

    def __init__(self, hidden: int, num_experts: int, intermediate: int, top_k: int, groups: int,
                 topk_groups: int, normalize: bool, scale: float, shared: int):
        super().__init__(num_experts, hidden, intermediate, bias=False, activation=silu_and_mul)
        self.gate = Router(hidden, num_experts)
        self.shared_experts = MLP(hidden, intermediate * shared)
        self.top_k, self.groups, self.topk_groups = top_k, groups, topk_groups
        self.normalize, self.scale = normalize, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = sigmoid_group_topk(self.gate(x), self.gate.e_score_correction_bias, self.top_k,
                                          self.groups, self.topk_groups, self.normalize, self.scale)
        return super().forward(x, ids, weights) + self.shared_experts(x)
