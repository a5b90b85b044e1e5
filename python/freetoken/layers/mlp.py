"""The dense feed-forward block: fused gate/up projection, SiLU-gated (GELU-gated: Gemma's
GeGLU), down projection."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from freetoken.kernels.plan import DTYPES, Available
from freetoken.layers.elementwise import gelu_tanh_and_mul, silu_and_mul
from freetoken.layers.linear import Linear


class MLP(nn.Module):
    # SwiGLU's kernel, chosen once by `plan_kernels` (kernels/plan.py): grouped_gemm.c's library,
    # or None (torch's ops); unplanned (a module built outside a load): silu_and_mul's default.
    swiglu_lib: ctypes.CDLL | None = NotImplemented

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def plan_kernels(self, kernels: Available, dtype: torch.dtype, device: torch.device | str) -> dict[str, str]:
        self.swiglu_lib = kernels.elementwise(dtype, device)
        return {"swiglu": swiglu_name(self.swiglu_lib, dtype)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.swiglu_lib))


def swiglu_name(lib: ctypes.CDLL | None, dtype: torch.dtype) -> str:
    return f"grouped_gemm.c silu_mul_{DTYPES[dtype]}" if lib is not None else "torch (lanewise)"


class GeGLU(MLP):
    """The gate through GELU's tanh approximation (transformers' `gelu_pytorch_tanh`)."""

    def plan_kernels(self, kernels: Available, dtype: torch.dtype, device: torch.device | str) -> dict[str, str]:
        return {"swiglu": "torch GeGLU (lanewise)"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))
