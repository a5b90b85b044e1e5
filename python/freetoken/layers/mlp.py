"""The dense feed-forward block: fused gate/up projection, SiLU-gated (GELU-gated: Gemma's
GeGLU), down projection."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.layers.elementwise import gelu_tanh_and_mul, silu_and_mul
from freetoken.layers.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class GeGLU(MLP):
    """The gate through GELU's tanh approximation (transformers' `gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))
