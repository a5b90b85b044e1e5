"""RMSNorm, as transformers computes it in each dtype: in one pass per row on CPUs where
kernels/grouped_gemm.c runs (its rms_norm_*), else through torch's ops. Given a layer's
residual stream and what the layer adds to it, the add and the norm share that pass."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels.grouped_gemm import KERNELS, add_rms_norm, rms_norm
from freetoken.kernels.grouped_gemm import load as load_kernel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

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
        """grouped_gemm.c's library where its rms_norm_* runs rows like x, else None."""
        if (x.device.type == "cpu" and x.dtype in KERNELS and x.dtype == self.weight.dtype
                and x.shape[-1] % 8 == 0):
            return load_kernel()
        return None
