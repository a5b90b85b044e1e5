"""RMSNorm (layers/norm.py, on grouped_gemm.c's rms_norm_* where it runs) against transformers'
formula computed in float64, and a row's bits against the rows beside it and the thread count."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import grouped_gemm as gg
from freetoken.layers.norm import RMSNorm

EPS = 1e-5


def _norm(dim: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(dim, EPS).to(dtype)
    norm.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    return norm


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm in float64: normalise, round to the model's dtype, scale."""
    h = x.double()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return weight.double() * normed.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 576, 100])  # 100: not a multiple of 8, torch's ops
def test_matches_transformers_formula(dtype, dim):
    norm = _norm(dim, dtype)
    x = (3 * torch.randn(70, dim, generator=torch.Generator().manual_seed(0))).to(dtype)
    with torch.inference_mode():
        got = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    expected = _reference(x, norm.weight)
    # bfloat16: the two roundings (normalised value, product), each half an ulp of 8 bits.
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert ((got.double() - expected).abs() / expected.abs().clamp_min(1e-3)).max().item() < tolerance


@pytest.mark.skipif(gg.load() is None, reason="the kernels cannot be built or run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_thread_count(dtype):
    norm = _norm(576, dtype)
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        try:
            torch.set_num_threads(1)
            one = norm(x)
            torch.set_num_threads(2)
            two = norm(x)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two)
        for r in (0, 1, 63, 64, 129):
            assert torch.equal(norm(x[r : r + 1])[0], one[r]), r
        # q heads of a fused q/k/v output: a strided view, normalised per head.
        heads = _norm(64, dtype)
        qkv = torch.randn(5, 12, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
        assert torch.equal(heads(qkv[:, :8]), heads(qkv[:, :8].contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 67])  # 67: over the kernel's threading threshold
def test_residual_add_and_norm_in_one_pass_give_the_bits_of_the_add_then_the_norm(dtype, rows):
    norm = _norm(576, dtype)
    gen = torch.Generator().manual_seed(4)
    x, delta = (torch.randn(2, rows, 576, generator=gen) * 3).to(dtype)
    with torch.inference_mode():
        expected_x = x + delta
        expected = norm(expected_x)
        got = norm(x, delta)
    assert torch.equal(x, expected_x) and torch.equal(got, expected)
