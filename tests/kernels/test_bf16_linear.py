"""The bfloat16 units' linears (bf16_linear.c) against a float64 matmul, and each row's bits at
every row count, thread count and place in its call: on the units this CPU has (the others skip)."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import bf16_linear
from freetoken.kernels.bf16_linear import pack_pairs, unit_linear, unpack_columns


@pytest.fixture(params=list(bf16_linear.UNITS))
def unit(request):
    if not bf16_linear.available(request.param):
        pytest.skip(f"this CPU has no {request.param} unit")
    return request.param


def test_rows_match_float64_and_keep_their_bits_at_every_row_count(unit):
    """1-300 rows (one or more row blocks, a short last block, several row chunks), each row at
    either end of its call, one thread or two: every row's bits as among 300 rows, and those
    within the float32 sum's one rounding to bfloat16 of a float64 matmul."""
    # The last 32-column strip partial; 4096 inputs: 128 k steps, and rows in chunks of 128 (the
    # rows whose x fills bf16_linear.c's CHUNK_BYTES).
    k, n = 4096, 80
    gen = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
    x = torch.randn(300, k, generator=gen).bfloat16()
    packed = pack_pairs(weight)
    full = unit_linear(unit, packed, bias, n, x)
    expected = x.double() @ weight.double().T + bias.double()
    assert ((full.double() - expected).abs() <= expected.abs() * 2**-8 + 1e-3).all()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(unit_linear(unit, packed, bias, n, x), full)
    finally:
        torch.set_num_threads(threads)
    for rows in range(1, 300):
        assert torch.equal(unit_linear(unit, packed, bias, n, x[:rows]), full[:rows]), rows
        assert torch.equal(unit_linear(unit, packed, bias, n, x[-rows:]), full[-rows:]), rows


def test_packing_is_undone_column_by_column():
    weight = torch.randn(70, 64).bfloat16()
    columns = torch.tensor([0, 15, 16, 31, 32, 69])
    assert torch.equal(unpack_columns(pack_pairs(weight), columns), weight[columns])
