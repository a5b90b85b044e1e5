"""The quantized-weight kernels (kernels/quant.py, quant_gemm.c) against gguf's numpy
dequantizers and float64 matmuls: dequantized values bit-equal, products within float32 rounding,
and every row's bits independent of its batch, its group, the thread count and the ISA path."""

import numpy as np
import pytest
import torch
from freetoken.kernels import quant
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from tests.fixtures.build_models import FP4_VALUES

pytestmark = pytest.mark.skipif(not quant.supported(T.Q4_0), reason="no quantized-weight kernel on this CPU")

N = 44  # not a multiple of the kernel's 8-column tiles
K_SMALL = 1120  # 35 blocks of 32: two K ranges of the kernel (at most 640 values each)
K_SUPER = 1280  # 5 super-blocks of 256: three K ranges (at most two super-blocks each)


def weight(qtype: T, rows: int = N, seed: int = 0) -> quant.QuantizedWeight:
    k = K_SUPER if GGML_QUANT_SIZES[qtype][0] == 256 else K_SMALL
    return quant.random_weight(qtype, (rows, k), seed)


def gguf_reference(w: quant.QuantizedWeight) -> torch.Tensor:
    with np.errstate(over="ignore"):  # MXFP4's largest scales overflow to infinity, ours too
        values = gguf_quants.dequantize(w.data.numpy(), w.qtype)
    return torch.from_numpy(values.astype(np.float32)).view(w.shape)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(params=sorted(quant.ISAS), ids=sorted(quant.ISAS))
def isa_cap(request, monkeypatch):
    if quant.ISAS[request.param] > quant._kernel().quant_isa():
        pytest.skip(f"this CPU lacks {request.param}")
    monkeypatch.setenv("FREETOKEN_QUANT_ISA", request.param)
    quant.isa.cache_clear()  # read once a process, as a load reads it
    yield request.param
    monkeypatch.delenv("FREETOKEN_QUANT_ISA")
    quant.isa.cache_clear()


@pytest.mark.parametrize("qtype", quant.FORMATS, ids=lambda t: t.name)
def test_dequantize_is_gguf_bit_for_bit(qtype, isa_cap):
    w = weight(qtype)
    assert torch.equal(quant.dequantize(w), gguf_reference(w))
    ids = torch.tensor([5, 0, 43, 5, 17])
    assert torch.equal(quant.dequantize_rows(w, ids), gguf_reference(w)[ids])


def test_mxfp4_dequantizes_every_scale_byte_as_gguf(isa_cap):
    w = quant.random_weight(T.MXFP4, (4, 8192), e8m0=(0, 256))  # subnormal to infinite
    assert torch.equal(quant.dequantize(w), gguf_reference(w))


@pytest.mark.parametrize("qtype", quant.FORMATS, ids=lambda t: t.name)
def test_quant_linear_matches_a_float64_product(qtype, isa_cap):
    w = weight(qtype)
    x = torch.randn(9, w.shape[1], generator=torch.Generator().manual_seed(1))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2))
    dense = gguf_reference(w).double()
    exact = x.double() @ dense.T + bias.double()
    scale = x.double().abs() @ dense.abs().T + bias.double().abs()
    y = quant.quant_linear(x, w, bias)
    assert y.dtype == torch.float32 and y.shape == (9, N)
    assert ((y.double() - exact).abs() <= 1e-5 * scale).all()
    # The bias is added once to the finished sum.
    assert torch.equal(y, quant.quant_linear(x, w, None) + bias)


@pytest.mark.parametrize("qtype", quant.FORMATS, ids=lambda t: t.name)
def test_every_row_gets_the_bits_it_gets_alone(qtype, isa_cap):
    w = weight(qtype)
    x = torch.randn(70, w.shape[1], generator=torch.Generator().manual_seed(3))  # row tiles of 3 and a part one
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([quant.quant_linear(x[r:r + 1], w, None) for r in range(len(x))])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 7, 13, 33, 64, 70):
                first = (rows * 7) % (len(x) - rows + 1)
                batch = quant.quant_linear(x[first:first + rows], w, None)
                assert torch.equal(batch, alone[first:first + rows]), (rows, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", quant.FORMATS, ids=lambda t: t.name)
def test_rows_past_one_work_item_match_float64_and_their_rows_alone(qtype, isa_cap, threads):
    w = weight(qtype)
    # More rows than one work item takes (at most 192), split into items that end in a part tile.
    x = torch.randn(250, w.shape[1], generator=torch.Generator().manual_seed(7))
    y = quant.quant_linear(x, w, None)
    dense = gguf_reference(w).double()
    exact, scale = x.double() @ dense.T, x.double().abs() @ dense.abs().T
    assert ((y.double() - exact).abs() <= 1e-5 * scale).all()
    assert torch.equal(y, torch.cat([quant.quant_linear(x[r:r + 1], w, None) for r in range(len(x))]))


@pytest.mark.parametrize("qtype", quant.FORMATS, ids=lambda t: t.name)
def test_few_rows_over_a_part_tile_match_float64_and_their_rows_alone(qtype, isa_cap):
    # 2-8 rows: a decode step's path (1-5 rows four columns at a time, 6-8 rows three or two);
    # 45 columns: the last work item's columns end in a part tile of either width.
    w = quant.random_weight(qtype, (45, K_SUPER), seed=8)
    x = torch.randn(8, K_SUPER, generator=torch.Generator().manual_seed(9))
    alone = torch.cat([quant.quant_linear(x[r:r + 1], w, None) for r in range(len(x))])
    dense = gguf_reference(w).double()
    assert ((alone.double() - x.double() @ dense.T).abs() <= 1e-5 * (x.double().abs() @ dense.abs().T)).all()
    for rows in range(2, len(x) + 1):
        assert torch.equal(quant.quant_linear(x[:rows], w, None), alone[:rows]), rows


@pytest.mark.parametrize("qtype", quant.FORMATS, ids=lambda t: t.name)
def test_few_rows_add_the_bias_once_in_every_column(qtype, isa_cap):
    # 1-8 rows store each tile's sums at once; 45 columns end in part tiles of 1-3 columns, whose
    # bias is read only for the columns there.
    w = quant.random_weight(qtype, (45, K_SUPER), seed=10)
    x = torch.randn(8, K_SUPER, generator=torch.Generator().manual_seed(11))
    bias = torch.randn(45, generator=torch.Generator().manual_seed(12))
    dense = gguf_reference(w).double()
    for rows in range(1, len(x) + 1):
        y = quant.quant_linear(x[:rows], w, bias)
        exact = x[:rows].double() @ dense.T + bias.double()
        scale = x[:rows].double().abs() @ dense.abs().T + bias.double().abs()
        assert ((y.double() - exact).abs() <= 1e-5 * scale).all(), rows
        assert torch.equal(y, quant.quant_linear(x[:rows], w, None) + bias), rows


@pytest.mark.parametrize("qtype", quant.FORMATS, ids=lambda t: t.name)
def test_avx2_and_avx512_paths_give_the_same_bits(qtype, monkeypatch):
    if quant._kernel().quant_isa() < quant.ISAS["avx512"]:
        pytest.skip("this CPU lacks AVX-512: one path only")
    w = weight(qtype)
    x = torch.randn(70, w.shape[1], generator=torch.Generator().manual_seed(4))
    wide = quant.quant_linear(x, w, None)
    monkeypatch.setenv("FREETOKEN_QUANT_ISA", "avx2")
    quant.isa.cache_clear()
    try:
        assert quant.isa() == quant.ISAS["avx2"]
        assert torch.equal(quant.quant_linear(x, w, None), wide)
    finally:
        monkeypatch.delenv("FREETOKEN_QUANT_ISA")
        quant.isa.cache_clear()


@pytest.mark.parametrize("qtype", quant.FORMATS, ids=lambda t: t.name)
def test_grouped_matches_each_expert_alone_bit_for_bit(qtype, threads):
    experts = 4
    flat = weight(qtype, rows=experts * N, seed=5)
    stacked = quant.QuantizedWeight(qtype, flat.data.view(experts, N, -1), (experts, N, flat.shape[1]))
    counts = [(2, 3), (0, 1), (3, 0), (1, 70), (2, 5)]  # (expert, rows), an empty group too
    x = torch.randn(sum(c for _, c in counts), flat.shape[1], generator=torch.Generator().manual_seed(6))
    groups, first = [], 0
    for expert, count in counts:
        groups.append((expert, first, count))
        first += count
    y = quant.grouped_quant_gemm(x, stacked, torch.tensor(groups))
    for expert, first, count in groups:
        one = quant.QuantizedWeight(qtype, stacked.data[expert], (N, flat.shape[1]))
        assert torch.equal(y[first:first + count], quant.quant_linear(x[first:first + count], one, None))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.MXFP4], ids=lambda t: t.name)
def test_grouped_k_parts_in_one_call_are_each_part_alone_bit_for_bit(qtype, threads):
    """Experts' down projections as tensor-parallel ranks hold them (distributed/parts.py): one
    call gives each K part's sums apart, the bits of that part's blocks run alone as a weight;
    within float32 rounding of the whole product."""
    experts, block = 3, GGML_QUANT_SIZES[qtype][0]
    flat = weight(qtype, rows=experts * N, seed=7)
    k = flat.shape[1]
    stacked = quant.QuantizedWeight(qtype, flat.data.view(experts, N, -1), (experts, N, k))
    cut = k // block // 3 * block  # uneven, as Qwen3-30B-A3B's 768 goes 256 + 512
    k_parts = [range(cut), range(cut, k)]
    groups = torch.tensor([(0, 0, 1), (2, 1, 9), (1, 10, 2)])
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(8))
    y = quant.grouped_quant_gemm(x, stacked, groups, k_parts)
    assert y.shape == (2, 12, N)
    for p, r in enumerate(k_parts):
        blocks = slice(quant.row_bytes(qtype, r.start), quant.row_bytes(qtype, r.stop))
        part = quant.QuantizedWeight(qtype, stacked.data[..., blocks], (experts, N, len(r)))
        assert torch.equal(y[p], quant.grouped_quant_gemm(x[:, r.start:r.stop].contiguous(), part, groups))
    dense = gguf_reference(stacked).double()
    exact = torch.cat([x[f:f + n].double() @ dense[e].T for e, f, n in groups.tolist()])
    scale = torch.cat([x[f:f + n].double().abs() @ dense[e].abs().T for e, f, n in groups.tolist()])
    assert ((y.double().sum(0) - exact).abs() <= 1e-5 * scale).all()


def test_parts_in_one_call_match_each_part_alone_bit_for_bit(isa_cap, threads):
    parts = [weight(T.Q4_1), weight(T.Q8_0, rows=20, seed=1), weight(T.MXFP4, rows=13, seed=2)]
    biases = [torch.randn(N, generator=torch.Generator().manual_seed(3)), None,
              torch.randn(13, generator=torch.Generator().manual_seed(4))]
    x = torch.randn(70, K_SMALL, generator=torch.Generator().manual_seed(5))  # row tiles of 3 and a part one
    for rows in (1, 3, 70):
        alone = torch.cat([quant.quant_linear(x[:rows], p, b) for p, b in zip(parts, biases)], dim=1)
        assert torch.equal(quant.quant_linear_parts(x[:rows], parts, biases), alone)


def test_bfloat16_rows_come_back_in_bfloat16():
    w = weight(T.Q4_1)
    x = torch.randn(3, w.shape[1]).bfloat16()
    y = quant.quant_linear(x, w, None)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, quant.quant_linear(x.float(), w, None).bfloat16())


def test_hf_mxfp4_converts_to_gguf_blocks_bit_for_bit():
    gen = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (3, 5, 12, 16), dtype=torch.uint8, generator=gen)  # [E, N, G, 16]
    scales = torch.randint(100, 150, (3, 5, 12), dtype=torch.uint8, generator=gen)
    w = quant.from_mxfp4_blocks(blocks, scales)
    assert w.shape == (3, 5, 384) and w.data.shape == (3, 5, 12 * 17)
    assert torch.equal(quant.dequantize(w), hf_mxfp4_reference(blocks, scales))


def hf_mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's HF layout read directly: value 2i in byte i's low nibble, 2i + 1 in its high one,
    times 2**(scale - 127)."""
    lut = torch.tensor(FP4_VALUES)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()
    values = torch.ldexp(lut[codes], scales.int()[..., None] - 127)
    return values.flatten(-2)


def test_without_kernels_nothing_is_supported_and_the_reference_answers(monkeypatch):
    w = weight(T.Q6_K)
    x = torch.randn(2, w.shape[1])
    monkeypatch.setenv("FREETOKEN_NO_KERNELS", "1")
    quant._kernel.cache_clear()
    try:
        assert not any(quant.supported(t) for t in quant.FORMATS)
        assert torch.equal(quant.dequantize(w), gguf_reference(w))
        assert torch.allclose(quant.quant_linear(x, w, None), x @ gguf_reference(w).T, rtol=1e-5, atol=1e-6)
    finally:
        monkeypatch.delenv("FREETOKEN_NO_KERNELS")
        quant._kernel.cache_clear()


def test_a_slice_of_whole_blocks_along_k_is_read_in_place():
    """As a tensor-parallel shard of a row-parallel layer: columns [k0, k1) of every row."""
    w = weight(T.Q4_K)
    block, size = GGML_QUANT_SIZES[T.Q4_K]
    shard = quant.QuantizedWeight(T.Q4_K, w.data[:, size:3 * size], (N, 2 * block))
    x = torch.randn(5, 2 * block)
    assert shard.data.data_ptr() == w.data.data_ptr() + size  # no copy
    expected = quant.quant_linear(x, quant.QuantizedWeight(T.Q4_K, shard.data.contiguous(), shard.shape), None)
    assert torch.equal(quant.quant_linear(x, shard, None), expected)
    assert torch.equal(quant.dequantize(shard), gguf_reference(w)[:, block:3 * block])


def test_blocks_not_matching_the_shape_are_refused():
    w = weight(T.Q8_0)
    with pytest.raises(ValueError, match="Q8_0 rows of 64 values are 68 bytes"):
        quant.quant_linear(torch.randn(1, 64), quant.QuantizedWeight(T.Q8_0, w.data, (N, 64)), None)
    with pytest.raises(IndexError):
        quant.dequantize_rows(w, torch.tensor([N]))
    k_quant = weight(T.Q4_K)  # 576 values: two whole blocks of 256 and a part
    part = quant.QuantizedWeight(T.Q4_K, k_quant.data[:, :quant.row_bytes(T.Q4_K, 576)], (N, 576))
    with pytest.raises(ValueError, match="Q4_K rows hold whole blocks of 256 values, not 576"):
        quant.quant_linear(torch.randn(40, 576), part, None)


@pytest.mark.parametrize("qtype", quant.FORMATS, ids=lambda t: t.name)
def test_k_parts_in_one_call_match_the_parts_alone_added_in_order(qtype, isa_cap):
    """A row-parallel layer's K parts (parts.RowParts, tensor parallelism's ranks) in one call:
    each output the parts' own sums added in part order, the bias in the first, bit for bit, on
    the few-row tiles and the panel (rows 9 and 100), parts of one K range and of two."""
    w, block = weight(qtype), GGML_QUANT_SIZES[qtype][0]
    k = w.shape[1]
    cut = k // block * 2 // 5 * block  # uneven: the later part spans more K ranges
    k_parts = [range(cut), range(cut, k)]
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1))
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(2))
    fused = quant.QuantParts([w], [bias], k_parts)
    for rows in (1, 5, 8, 9, 100):
        assert torch.equal(fused(x[:rows]), parts_alone_added(w, x[:rows], bias, k_parts)), rows


def parts_alone_added(w: quant.QuantizedWeight, x: torch.Tensor, bias: torch.Tensor,
                      k_parts: list[range]) -> torch.Tensor:
    """Each K part's blocks as a weight of its own, run alone (the bias in the first), the
    products added in part order: what tensor-parallel ranks and their sum compute."""
    total = None
    for p, r in enumerate(k_parts):
        blocks = quant.row_bytes(w.qtype, r.start), quant.row_bytes(w.qtype, r.stop)
        part = quant.QuantizedWeight(w.qtype, w.data[:, blocks[0]:blocks[1]], (w.shape[0], len(r)))
        partial = quant.quant_linear(x[:, r.start:r.stop].contiguous(), part, bias if p == 0 else None)
        total = partial if total is None else total.add_(partial)
    return total


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_a_long_k_over_items_of_several_tiles_matches_rows_alone_and_k_parts(qtype, isa_cap, threads):
    """A K whose rows of x outgrow L2 (12288, the 8B's down_proj): items of several column tiles,
    each K range run for all of them in turn (then 60 rows in one item, 44 columns in two), the
    same bits as each row alone, and with K parts (row-parallel layers) as the parts added."""
    k = 12288
    w = quant.random_weight(qtype, (N, k), seed=8)
    x = torch.randn(60, k, generator=torch.Generator().manual_seed(9))
    y = quant.quant_linear(x, w, None)
    dense = gguf_reference(w).double()
    exact, scale = x.double() @ dense.T, x.double().abs() @ dense.abs().T
    assert ((y.double() - exact).abs() <= 1e-5 * scale).all()
    assert torch.equal(y, torch.cat([quant.quant_linear(x[r:r + 1], w, None) for r in range(len(x))]))
    k_parts = [range(5120), range(5120, k)]
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1))
    assert torch.equal(quant.QuantParts([w], [bias], k_parts)(x), parts_alone_added(w, x, bias, k_parts))
