"""The int8-activation kernel (kernels/int8.py, int8_gemm.c) against its arithmetic computed
independently in numpy: the rows quantized per block of 32 in float32, the weights' integer codes
and scales read through gguf's own dequantizers (the blocks' float16 scales set to 1 and 0), the
per-block sums in int64 and the float32 accumulation in the same order; MXFP4's codes likewise
(its E8M0 scale byte set to 128: a scale of 1), its scales gguf's e8m0_to_fp32_half. Bit for bit, at
every batch size, on both paths and thread counts."""

from itertools import pairwise

import numpy as np
import pytest
import torch
from freetoken.kernels import int8
from freetoken.kernels.quant import QuantizedWeight, random_weight, row_bytes
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

pytestmark = pytest.mark.skipif(not int8.supported(random_weight(T.Q8_0, (1, 32))),
                                reason="int8_gemm.c is not built here (no C compiler, or FREETOKEN_NO_KERNELS)")

N = 41  # not a multiple of the kernel's 8-column items: the last has one
K = 1280  # 5 super-blocks: 40 blocks of 32, Q8_0's in units of 8
HALF = {T.Q8_0: 0, T.Q4_K: 0, T.Q5_K: 0, T.Q6_K: 208, T.MXFP4: 0}  # each block's float16 d (MXFP4: E8M0 e)
# Rows of an item that int8_gemm.c's AVX2 path multiplies as it unpacks them (up to FEW = 4, two
# at a time), and of one that goes through the tile; on the VNNI paths, 1-2 made in registers, the
# tile's groups of four rows and every remainder (3, 4, 9 = 4 + 4 + 1).
ROWS = (1, 2, 3, 4, 9)
ONE, ZERO = (np.array([v], np.float16).view(np.uint8) for v in (1, 0))
E8M0_ONE = np.array([128], np.uint8)  # e8m0_to_fp32_half(128) = 1


def _with_scales(w: QuantizedWeight, d: np.ndarray, dmin: np.ndarray | None) -> np.ndarray:
    """gguf's values of w's blocks with every d (and dmin) set to the given float16 bytes."""
    size = {T.Q8_0: 34, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210, T.MXFP4: 17}[w.qtype]
    blocks = w.data.numpy().reshape(w.shape[0], -1, size).copy()
    at = HALF[w.qtype]
    blocks[..., at:at + len(d)] = d
    if dmin is not None:
        blocks[..., 2:4] = dmin
    return gguf_quants.dequantize(blocks.reshape(w.shape[0], -1), w.qtype).reshape(w.shape)


def reference(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None,
              cuts: tuple[int, ...] | None = None) -> torch.Tensor:
    x = x.numpy().astype(np.float32)
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32)
    dx = np.abs(blocks).max(-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(dx != 0, np.float32(1) / dx, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int64)
    bsum = q.sum(-1).astype(np.float32)
    # a*c per value (integers): gguf's values with d = 1 (and dmin = 0); the float scales as stored.
    size = w.data.shape[-1] // (k // int8_block(w.qtype))
    raw = w.data.numpy().reshape(w.shape[0], -1, size)
    at = HALF[w.qtype]
    if w.qtype == T.MXFP4:
        d = gguf_quants.MXFP4.e8m0_to_fp32_half(raw[..., at])  # [N, blocks]
        codes = _with_scales(w, E8M0_ONE, None)
        # s * c: gguf's own values, bit for bit (e = 0, 1 subnormal, 255 2^127, products past it inf).
        assert np.array_equal((d[..., None] * codes.reshape(*d.shape, 32)).reshape(w.shape),
                              gguf_quants.dequantize(w.data.numpy(), w.qtype).reshape(w.shape))
        codes = codes.astype(np.int64)
    else:
        d = raw[..., at:at + 2].copy().view(np.float16).astype(np.float32)[..., 0]  # [N, blocks of the format]
        codes = _with_scales(w, ONE, ZERO if w.qtype in (T.Q4_K, T.Q5_K) else None).astype(np.int64)
    per = int8_block(w.qtype) // 32
    s = np.repeat(d, per, axis=1)
    m = np.zeros_like(s)
    if w.qtype in (T.Q4_K, T.Q5_K):
        dmin = raw[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        mins = np.abs(_with_scales(w, ZERO, ONE).reshape(w.shape[0], -1, 32)[..., 0]).astype(np.float32)
        m = -(np.repeat(dmin, per, axis=1) * mins)
    sums = np.einsum("rjv,njv->rnj", q, codes.reshape(w.shape[0], -1, 32))
    cuts = cuts or (0, k)
    y = None
    for start, stop in pairwise(cuts):
        acc = np.zeros((rows, w.shape[0]), np.float32)
        for j in range(start // 32, stop // 32):
            term = s[None, :, j] * sums[:, :, j].astype(np.float32) + m[None, :, j] * bsum[:, j, None]
            acc = acc + dx[:, j, None] * term
        if y is None:
            y = acc if bias is None else acc + bias.numpy()
        else:
            y = y + acc
    return torch.from_numpy(y)


def int8_block(qtype: T) -> int:
    return 32 if qtype in (T.Q8_0, T.MXFP4) else 256


def paths():
    return [pytest.param(p, marks=pytest.mark.skipif(
        not int8.runs(p), reason=f"this CPU lacks {name.upper()}")) for name, p in int8.PATHS.items()]


@pytest.fixture(params=paths(), ids=list(int8.PATHS))
def path(request):
    return request.param


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", int8.FORMATS, ids=lambda t: t.name)
def test_matches_the_arithmetic_computed_in_numpy_bit_for_bit(qtype, rows, path):
    """And the rows alone get the bits they get inside a batch of 70 (through the tile)."""
    k = 1120 if int8_block(qtype) == 32 else K  # Q8_0, MXFP4: 35 blocks, the last unit of 3
    w = random_weight(qtype, (N, k), seed=1)
    batch = torch.randn(70, k, generator=torch.Generator().manual_seed(2))
    batch[3, 64:96] = 0  # a block of zeros: scale 0
    x = batch[3:3 + rows]
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3))
    # Whole, and as a tensor-parallel group's parts of K.
    for parts, cuts in ((None, None), ([range(512), range(512, k)], (0, 512, k))):
        linear = int8.Int8Parts([w], [bias], parts, path=path)
        y = linear(x)
        assert torch.equal(y, reference(x, w, bias, cuts))
        assert torch.equal(y, linear(batch)[3:3 + rows])


@pytest.mark.parametrize("qtype", int8.FORMATS, ids=lambda t: t.name)
def test_every_row_gets_the_bits_it_gets_alone(qtype, path):
    w = random_weight(qtype, (N, 512), seed=4)
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = int8.Int8Parts([w], [None], path=path)(x)
        torch.set_num_threads(1)
        for first, rows in ((0, 1), (150, 1), (5, 2), (61, 3), (200, 4), (7, 8), (3, 64), (100, 65), (0, 300)):
            assert torch.equal(int8.Int8Parts([w], [None], path=path)(x[first:first + rows]),
                               full[first:first + rows]), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", int8.FORMATS, ids=lambda t: t.name)
def test_every_path_the_cpu_runs_gives_the_scalar_paths_bits(qtype):
    others = [p for p in int8.PATHS.values() if p and int8.runs(p)]
    if not others:
        pytest.skip("this CPU lacks AVX2: the scalar path only")
    w = random_weight(qtype, (N, K), seed=6)
    x = torch.randn(70, K, generator=torch.Generator().manual_seed(7)) * 3
    scalar = int8.Int8Parts([w], [None], path=0)(x)
    for p in others:  # (70 rows: items of 64 through the tile and of 6 made in registers)
        assert torch.equal(int8.Int8Parts([w], [None], path=p)(x), scalar), p


@pytest.mark.parametrize("qtype", int8.FORMATS, ids=lambda t: t.name)
def test_grouped_experts_get_each_experts_bits_alone(qtype):
    flat = random_weight(qtype, (4 * N, 768), seed=15)
    stacked = QuantizedWeight(qtype, flat.data.view(4, N, -1), (4, N, 768))
    # (expert, first row, rows): a group past one work item, an empty one, an expert twice, and
    # groups of a decode step's 1-2 rows, one of them a row of the 70 again.
    groups = torch.tensor([(2, 0, 3), (0, 3, 1), (3, 4, 0), (1, 4, 70), (2, 74, 5), (1, 79, 1), (3, 80, 2)])
    x = torch.randn(82, 768, generator=torch.Generator().manual_seed(16))
    x[79] = x[10]
    y = int8.grouped_int8_gemm(x, stacked, groups)
    for expert, first, count in groups.tolist():
        one = QuantizedWeight(qtype, stacked.data[expert], (N, 768))
        rows = x[first:first + count]
        assert torch.equal(y[first:first + count], int8.Int8Parts([one], [None])(rows))
        assert torch.equal(y[first:first + count], reference(rows, one, None))
    assert torch.equal(y[79], y[10])


@pytest.mark.parametrize("qtype", int8.FORMATS, ids=lambda t: t.name)
def test_grouped_k_parts_are_each_parts_blocks_alone(qtype):
    """Experts' down projections as tensor-parallel ranks hold them (distributed/parts.py): each
    part's sums are the int64 reference of that part's blocks alone."""
    flat = random_weight(qtype, (3 * N, 768), seed=17)
    stacked = QuantizedWeight(qtype, flat.data.view(3, N, -1), (3, N, 768))
    k_parts = [range(256), range(256, 768)]  # uneven, as Qwen3-30B-A3B's 768 between two ranks
    groups = torch.tensor([(1, 0, 2), (0, 2, 5), (2, 7, 1)])
    x = torch.randn(8, 768, generator=torch.Generator().manual_seed(18))
    y = int8.grouped_int8_gemm(x, stacked, groups, k_parts=k_parts)
    assert y.shape == (2, 8, N)
    for p, r in enumerate(k_parts):
        for expert, first, count in groups.tolist():
            blocks = flat.data.view(3, N, -1)[expert, :, row_bytes(qtype, r.start):row_bytes(qtype, r.stop)]
            one = QuantizedWeight(qtype, blocks.contiguous(), (N, len(r)))
            expected = reference(x[first:first + count, r.start:r.stop].contiguous(), one, None)
            assert torch.equal(y[p, first:first + count], expected)
    if int8_block(qtype) > 32:
        with pytest.raises(ValueError, match="whole blocks"):
            int8.grouped_int8_gemm(x, stacked, groups, k_parts=[range(128), range(128, 768)])


@pytest.mark.parametrize("rows", (1, 2, 9))
def test_mxfp4_every_scale_byte(rows, path):
    """Every E8M0 byte, the edges (0 and 1: subnormal scales, 254 and 255: products past float32's
    range, inf and NaN where they meet) among them, a row's scale bytes all one value; AVX2 and
    scalar alike. Eleven blocks: a whole unit of eight (read by byte permute on avx512_vbmi), then
    three (gathered)."""
    w = random_weight(T.MXFP4, (256, 352), seed=20)
    w.data.view(256, 11, 17)[:, :, 0] = torch.arange(256, dtype=torch.uint8)[:, None]
    w.data.view(256, 11, 17)[255, 0, 0] = 7  # a mix in one row too
    w.data.view(256, 11, 17)[254, 5, 0] = 0
    x = torch.randn(70, 352, generator=torch.Generator().manual_seed(21))
    y = int8.Int8Parts([w], [None], path=path)(x[:rows])
    with np.errstate(over="ignore", invalid="ignore"):
        expected = reference(x[:rows], w, None)
    torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(y[:, :230]).all() and not torch.isfinite(y[:, 250:254]).all()  # (2^-127 * 12 * 127)
    assert torch.equal(y[:, :230], int8.Int8Parts([w], [None], path=path)(x)[:rows, :230])


def test_the_probe_finds_the_paths_the_cpu_has():
    with open("/proc/cpuinfo") as f:
        flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    avx2 = {"avx2", "f16c"} <= flags  # the path converts scales with F16C too
    avx512 = avx2 and {"avx512_vnni", "avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags
    has = {"scalar": True, "avx2": avx2, "avx512_vnni": avx512, "avx_vnni": avx2 and "avx_vnni" in flags,
           "avx512_vbmi": avx512 and "avx512vbmi" in flags}
    assert {name: int8.runs(p) for name, p in int8.PATHS.items()} == has
    assert int8.best_path() == max(int8.PATHS[name] for name, ok in has.items() if ok)


def test_parts_in_one_call_are_each_part_alone():
    parts = [random_weight(T.Q4_K, (N, K), 8), random_weight(T.Q6_K, (20, K), 9), random_weight(T.Q8_0, (13, K), 10),
             random_weight(T.MXFP4, (9, K), 19)]
    biases = [None, torch.randn(20, generator=torch.Generator().manual_seed(11)), None, None]
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(12))
    alone = torch.cat([int8.Int8Parts([p], [b])(x) for p, b in zip(parts, biases)], dim=1)
    assert torch.equal(int8.Int8Parts(parts, biases)(x), alone)
    assert int8.Int8Parts(parts, biases)(x.bfloat16()).dtype == torch.bfloat16


def test_error_against_the_float64_product_is_int8_rounding():
    # Not the exactness contract: the activations' 8 bits set the error (a relative 2^-8 per block).
    w = random_weight(T.Q4_K, (N, K), seed=13)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(14))
    dense = torch.from_numpy(gguf_quants.dequantize(w.data.numpy(), w.qtype)).double()
    err = (int8.Int8Parts([w], [None])(x).double() - x.double() @ dense.T).abs()
    assert (err <= 2 ** -8 * (x.double().abs() @ dense.abs().T)).all()
