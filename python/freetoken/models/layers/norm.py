"""RMSNorm, as transformers computes it in each dtype: in one pass per row on CPUs where
models/kernels/grouped_gemm.c runs (its rms_norm_*), else through torch's ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.models.kernels.grouped_gemm import KERNELS, rms_norm
from freetoken.models.kernels.grouped_gemm import load as load_kernel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu" and x.dtype in KERNELS and x.dtype == self.weight.dtype
                and x.shape[-1] % 8 == 0 and (lib := load_kernel()) is not None):
            return rms_norm(lib, x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and scale after the cast, as transformers does.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)
