"""The rotation of q and k (models/layers/rotary.py, on grouped_gemm.c's rotate_* where it runs)
against transformers' own formula, bit for bit, on the strided q/k views attention passes."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import rotate_half

from freetoken.models.layers.rotary import cos_sin, rotate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, dim", [(1, 15, 64), (300, 15, 64), (7, 4, 128), (3, 2, 24)])
def test_matches_transformers_bit_for_bit(dtype, tokens, heads, dim):
    gen = torch.Generator().manual_seed(0)
    qkv = (4 * torch.randn(tokens, heads + 3, dim, generator=gen)).to(dtype)
    x = qkv[:, :heads]  # q and k of a fused projection: rows (heads + 3) * dim apart
    cos, sin = cos_sin(torch.arange(tokens) * 5 + 2, dim, 10000.0, None, dtype)
    with torch.inference_mode():
        got = rotate(x, cos, sin)
    assert torch.equal(got, x * cos + rotate_half(x) * sin)
