"""SwiGLU's bits: a row's output does not depend on how many rows share its call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken.layers.elementwise import silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("half", [1536, 96])  # a multiple of the vector pairs, and a TP rank's share
def test_a_row_gets_the_same_bits_in_any_batch(dtype, half):
    gate_up = torch.randn(300, 2 * half, generator=torch.Generator().manual_seed(0)).to(dtype)
    together = silu_and_mul(gate_up)
    for row in (0, 21, 22, 150, 299):
        assert torch.equal(silu_and_mul(gate_up[row : row + 1]), together[row : row + 1])
    for rows in (slice(0, 5), slice(17, 64), slice(100, 300)):
        assert torch.equal(silu_and_mul(gate_up[rows]), together[rows])
    exact = F.silu(gate_up[:, :half].double()) * gate_up[:, half:].double()
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.double(), exact, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 45])  # 45 x 1536: over the kernel's threading threshold
def test_the_one_pass_swiglu_gives_torchs_vector_path_bits(dtype, rows):
    """silu_mul_* against torch's SiLU and product on a tensor whose every element takes torch's
    vector path (one thread, whole vector pairs), exp's range ends included."""
    half = 1536
    gate_up = 8 * torch.randn(rows, 2 * half, generator=torch.Generator().manual_seed(rows))
    ends = torch.tensor([-200.0, -104.5, -103.9, -87.5, -0.0, 0.0, 88.7, 100.5, float("inf")])
    gate_up[0, : len(ends)] = ends
    gate_up = gate_up.to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = F.silu(gate_up[:, :half].contiguous()) * gate_up[:, half:]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(silu_and_mul(gate_up), expected)
