"""The dense feed-forward block: fused gate/up projection, SiLU-gated, down projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.models.layers.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        half = gate_up.shape[-1] // 2
        # silu makes the gate half contiguous; multiplying in place saves a tensor the size of it.
        return self.down_proj(F.silu(gate_up[:, :half]).mul_(gate_up[:, half:]))
