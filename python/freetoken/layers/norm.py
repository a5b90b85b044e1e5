"""RMSNorm, as transformers computes it in each dtype: in one pass per row where the kernel plan
(kernels/plan.py) put it on grouped_gemm.c (its rms_norm_*), else through torch's ops. Given a
layer's residual stream and what the layer adds to it, the add and the norm share that pass."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels.grouped_gemm import KERNELS, add_rms_norm, rms_norm
from freetoken.kernels.plan import Available, available


class RMSNorm(nn.Module):
    # grouped_gemm.c's library where its rms_norm_* runs this norm's rows, else None (torch's
    # ops): chosen once by `plan_kernels` (a module built outside a load, at its first call).
    lib: ctypes.CDLL | None = NotImplemented

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def plan_kernels(self, kernels: Available, dtype: torch.dtype, device: torch.device | str) -> dict[str, str]:
        """kernels/plan.py's question: the kernel for rows of this norm's weight dtype."""
        weight = self.weight
        self.lib = kernels.elementwise(weight.dtype, weight.device) if weight.shape[-1] % 8 == 0 else None
        return {"norm": f"grouped_gemm.c rms_norm_{KERNELS[weight.dtype]}" if self.lib else "torch"}

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of x; with `delta` (x's shape and dtype), of x + delta, which is written into x
        first (the residual stream, updated in place)."""
        lib = self.kernel(x)
        if delta is not None:
            if (lib is not None and x.dim() == 2 and delta.dtype == x.dtype
                    and x.stride(-1) == delta.stride(-1) == 1):
                return add_rms_norm(lib, x, delta, self.weight, self.eps)
            x.add_(delta)
        if lib is not None:
            return rms_norm(lib, x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and scale after the cast, as transformers does.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def kernel(self, x: torch.Tensor) -> ctypes.CDLL | None:
        """The planned library where rows like x are of the weight's dtype (the kernel's
        contract), else None."""
        if self.lib is NotImplemented:
            self.plan_kernels(available(), x.dtype, x.device)
        return self.lib if x.dtype == self.weight.dtype else None
