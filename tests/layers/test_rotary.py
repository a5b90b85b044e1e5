"""The rotation of q and k (layers/rotary.py, on grouped_gemm.c's rotate_* where it runs)
against transformers' own formula, bit for bit, on the strided q/k views attention passes."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import rotate_half

from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import cos_sin, norm_rotate, rotate


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, normed", [(1, True), (5, False), (67, True)])  # 67: threaded
def test_q_k_norm_and_rotation_in_place_give_the_bits_of_norms_then_rotation(dtype, tokens, normed):
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 8, 3, 64
    qkv = (4 * torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen)).to(dtype)
    norms = None
    if normed:
        norms = tuple(RMSNorm(dim, 1e-6).to(dtype) for _ in range(2))
        for norm in norms:
            norm.weight.data = torch.randn(dim, generator=gen).to(dtype)
    cos, sin = cos_sin(torch.arange(tokens) * 3 + 1, dim, 10000.0, None, dtype)
    with torch.inference_mode():
        x = qkv[:, : heads + kv_heads]
        if normed:
            x = torch.cat([norms[0](x[:, :heads]), norms[1](x[:, heads:])], dim=1)
        expected = x * cos + rotate_half(x) * sin
        v = qkv[:, heads + kv_heads :].clone()
        got = norm_rotate(qkv[:, : heads + kv_heads], heads, norms, cos, sin)
    assert torch.equal(got, expected) and torch.equal(qkv[:, heads + kv_heads :], v)
