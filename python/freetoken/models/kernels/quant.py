"""Quantized weights kept in GGUF's block layouts, as the file stores them, and the matmuls that
read them.

INTERFACE STUB: the functions below run through the `gguf` package's numpy dequantizers and
torch; the C kernels (quant_gemm.c) replace their insides, keeping these signatures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

# The block formats kept quantized (the others are dequantized at load).
FORMATS = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
           GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
           GGMLQuantizationType.MXFP4)


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear layer's weight [N, K] (or a layer's experts [E, N, K]) as GGUF blocks: `data`
    is uint8 [N, row_bytes] ([E, N, row_bytes]), each row K // block_size blocks along K, as the
    file stores it (may be a view on a read-only memory map)."""

    qtype: GGMLQuantizationType
    data: torch.Tensor
    shape: tuple[int, ...]  # logical (N, K) or (E, N, K)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def row_bytes(qtype: GGMLQuantizationType, k: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return k // block * size


def supported(qtype: GGMLQuantizationType) -> bool:
    """Is there a kernel for `qtype` on this CPU?"""
    return qtype in FORMATS


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight, [N, K] (or [E, N, K])."""
    values = gguf_quants.dequantize(weight.data.numpy(), weight.qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(weight.shape)


def dequantize_rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a [N, K] weight as float32 [len(ids), K] (an embedding lookup)."""
    picked = weight.data[ids.cpu()]
    values = gguf_quants.dequantize(picked.numpy(), weight.qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(len(ids), weight.shape[-1])


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [R, K] (float32 or bfloat16) @ weight[N, K]^T + bias: [R, N] in x's dtype, float32 sums."""
    y = x.float() @ dequantize(weight).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def grouped_quant_gemm(x: torch.Tensor, experts: QuantizedWeight, groups: torch.Tensor) -> torch.Tensor:
    """As models/kernels/grouped_gemm.py's grouped_gemm, experts [E, N, K] quantized: groups [G, 3]
    int64 (expert, first row, row count) covering every row of x; [R, N] in x's dtype."""
    y = torch.empty(x.shape[0], experts.shape[1], dtype=torch.float32)
    full = dequantize(experts)
    for expert, first, count in groups.tolist():
        y[first:first + count] = x[first:first + count].float() @ full[expert].T
    return y.to(x.dtype)
