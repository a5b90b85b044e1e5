"""The dense feed-forward block: fused gate/up projection, SiLU-gated, down projection."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.models.layers.elementwise import silu_and_mul
from freetoken.models.layers.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
