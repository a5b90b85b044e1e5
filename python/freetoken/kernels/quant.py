"""Quantized weights kept in GGUF's block layouts, as the file stores them, and the matmuls that
read them.

The kernels (csrc/quant_gemm.c, built at first use by build.py) read the
blocks in place and dequantize them in registers, to exactly gguf's float32 values. Each output
element is one sum in a fixed order (sixteen lanes of FMA chains along K, then a fixed tree; see
the C file) whatever the row count, tile, thread or group, and the AVX2 and AVX-512 paths give the
same bits: a row's output never depends on its batch. Where the kernel cannot run (no C compiler, a CPU
without AVX2/FMA/F16C, FREETOKEN_NO_KERNELS set), `supported()` is False and the loader
dequantizes at load; the functions here still answer, through gguf's numpy dequantizers.
FREETOKEN_QUANT_ISA=avx2 caps the kernel at AVX2 (tests and benchmarks compare the paths).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from freetoken import envs
from freetoken.kernels import build

# The block formats kept quantized (the others are dequantized at load).
FORMATS = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
           GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
           GGMLQuantizationType.MXFP4)
ISAS = {"avx2": 1, "avx512": 2}
# Where each format keeps float16 scales (byte offsets in a block), for `random_weight`.
_HALF_SCALES = {GGMLQuantizationType.Q8_0: (0,), GGMLQuantizationType.Q4_0: (0,), GGMLQuantizationType.Q4_1: (0, 2),
                GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2), GGMLQuantizationType.Q6_K: (208,)}


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


@cache
def _kernel() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot run here (logged once)."""
    lib = build.open_library("quant_gemm", "quant_isa", "AVX2/FMA/F16C", "quantized layers are dequantized at load")
    if lib is not None:
        lib.best_isa = lib.quant_isa()  # asked once more, then kept: CPUID is slow under a hypervisor
    return lib


@cache
def isa() -> int:
    """The kernel path this process runs: 2 AVX-512, 1 AVX2, 0 none (FREETOKEN_QUANT_ISA caps it,
    read once: the kernel plan's choice, never asked again in a step)."""
    lib = _kernel()
    if lib is None:
        return 0
    return min(lib.best_isa, ISAS.get(envs.QUANT_ISA.get() or "", 2))


def supported(qtype: GGMLQuantizationType) -> bool:
    """Is there a kernel for `qtype` on this CPU?"""
    return qtype in FORMATS and _kernel() is not None


def _blocks(data: torch.Tensor, qtype: GGMLQuantizationType, k: int) -> torch.Tensor:
    """`data` checked to hold K's blocks in each row, bytes contiguous within a row (rows and
    experts may be strided: a slice of whole blocks along K is read in place)."""
    block = GGML_QUANT_SIZES[qtype][0]
    if k % block:  # the kernel dequantizes whole blocks: a part block's values would be garbage
        raise ValueError(f"{qtype.name} rows hold whole blocks of {block} values, not {k}")
    if data.dtype != torch.uint8 or data.shape[-1] != row_bytes(qtype, k):
        raise ValueError(f"{qtype.name} rows of {k} values are {row_bytes(qtype, k)} bytes, "
                         f"got {data.dtype} {tuple(data.shape)}")
    return data if data.stride(-1) == 1 else data.contiguous()


def blocks(weight: QuantizedWeight) -> torch.Tensor:
    """A weight's bytes as the kernels read them (`_blocks`: each row's blocks contiguous)."""
    return _blocks(weight.data, weight.qtype, weight.shape[-1])


def _rows(data: torch.Tensor, ids: torch.Tensor | None, qtype: GGMLQuantizationType, k: int) -> torch.Tensor:
    """Rows `ids` (None: all) of blocks `data` [rows, row_bytes] as float32 [n, k]."""
    lib = _kernel()
    if lib is None or qtype not in FORMATS:
        picked = data if ids is None else data[ids]
        values = gguf_quants.dequantize(picked.numpy(), qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(-1, k)
    data = _blocks(data, qtype, k)
    n = data.shape[0] if ids is None else ids.numel()
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        if n and (ids.min() < 0 or ids.max() >= data.shape[0]):
            raise IndexError(f"row ids out of range for {data.shape[0]} rows")
    out = torch.empty(n, k, dtype=torch.float32)
    lib.quant_dequantize_rows(isa(), int(qtype), data.data_ptr(), data.stride(0),
                              None if ids is None else ids.data_ptr(), n, k, out.data_ptr())
    return out


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight, [N, K] (or [E, N, K])."""
    rows = weight.data.reshape(-1, weight.data.shape[-1])
    return _rows(rows, None, weight.qtype, weight.shape[-1]).view(weight.shape)


def dequantize_rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a [N, K] weight as float32 [len(ids), K] (an embedding lookup)."""
    return _rows(weight.data, ids.cpu().reshape(-1), weight.qtype, weight.shape[-1])


class QuantParts:
    """Quantized weights [N_p, K] (each in its own format) run as one projection, x @ [W_0; W_1;
    ...]^T + [b_0; b_1; ...], in one kernel call: the arrays the kernel reads are made once here
    (the weights and biases are fixed from then on). `k_parts` (ranges of whole blocks covering K
    in order): each output the sum over each range on its own (as this class computes a weight of
    that range alone), added in range order, the bias in the first: the bits of a tensor-parallel
    group's ranks' partial products summed in rank order (distributed/parts.py)."""

    def __init__(self, parts: list[QuantizedWeight], biases: list[torch.Tensor | None],
                 k_parts: list[range] | None = None):
        self.k = parts[0].shape[-1]
        self.n = sum(p.shape[0] for p in parts)
        # Kept: the kernel reads their memory.
        self.blocks = [_blocks(p.data, p.qtype, self.k) for p in parts]
        self.biases = [None if b is None else b.float().contiguous() for b in biases]
        count, cuts = len(parts), None
        if k_parts is not None:
            block_sizes = {GGML_QUANT_SIZES[p.qtype][0] for p in parts}
            if ([r.start for r in k_parts] + [self.k] != [0] + [r.stop for r in k_parts]
                    or any(r.start % b or len(r) <= 0 for r in k_parts for b in block_sizes)):
                raise ValueError(f"K parts {k_parts} do not cover {self.k} in whole blocks of {block_sizes}")
            cuts = (ctypes.c_int64 * (len(k_parts) + 1))(*(r.start for r in k_parts), self.k)
        self.args = (count, (ctypes.c_int * count)(*(int(p.qtype) for p in parts)),
                     (ctypes.c_void_p * count)(*(b.data_ptr() for b in self.blocks)),
                     (ctypes.c_int64 * count)(*(b.stride(0) for b in self.blocks)),
                     (ctypes.c_int64 * count)(*(p.shape[0] for p in parts)),
                     (ctypes.c_void_p * count)(*(None if b is None else b.data_ptr() for b in self.biases)),
                     0 if k_parts is None else len(k_parts), cuts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, K] (float32 or bfloat16): [R, sum N_p] in x's dtype, float32 sums."""
        rows = x.float().contiguous()
        if rows.shape[1] != self.k:
            raise ValueError(f"x has {rows.shape[1]} features, the weight {self.k}")
        y = torch.empty(rows.shape[0], self.n, dtype=torch.float32)
        _kernel().quant_gemm_parts(isa(), *self.args, rows.data_ptr(), rows.stride(0), y.data_ptr(),
                                   self.n, rows.shape[0], self.k)
        return y if x.dtype == torch.float32 else y.to(x.dtype)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [R, K] (float32 or bfloat16) @ weight[N, K]^T + bias: [R, N] in x's dtype, float32 sums."""
    return quant_linear_parts(x, [weight], [bias])


def quant_linear_parts(x: torch.Tensor, parts: list[QuantizedWeight | torch.Tensor],
                       biases: list[torch.Tensor | None]) -> torch.Tensor:
    """x [R, K] @ [part0; part1; ...]^T + [bias0; bias1; ...], [R, sum N_p] in x's dtype, each part
    a QuantizedWeight or a float weight [N_p, K] (one that had no kernel, dequantized at load:
    it runs F.linear in its own dtype)."""
    if all(isinstance(p, QuantizedWeight) and supported(p.qtype) for p in parts):
        return QuantParts(parts, biases)(x)
    outs = []
    for part, bias in zip(parts, biases):
        if not isinstance(part, QuantizedWeight):
            outs.append(torch.nn.functional.linear(x, part, bias))
        elif supported(part.qtype):
            outs.append(QuantParts([part], [bias])(x))
        else:
            product = x.float() @ dequantize(part).T
            outs.append((product if bias is None else product + bias.float()).to(x.dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def check_k_parts(parts: list[range], k: int, qtype: GGMLQuantizationType) -> None:
    """Raises unless `parts` cover K in order, each whole blocks of `qtype`."""
    block = GGML_QUANT_SIZES[qtype][0]
    if [r.start for r in parts] + [k] != [0] + [r.stop for r in parts] or any(r.start % block for r in parts):
        raise ValueError(f"K parts {parts} do not cover {k} in whole blocks of {block}")


def grouped_quant_gemm(x: torch.Tensor, experts: QuantizedWeight, groups: torch.Tensor,
                       k_parts: list[range] | None = None) -> torch.Tensor:
    """As kernels/grouped_gemm.py's grouped_gemm, experts [E, N, K] quantized: groups [G, 3]
    int64 (expert, first row, row count) covering every row of x; [R, N] in x's dtype. With
    `k_parts` (ranges of whole blocks covering K in order): [len(k_parts), R, N], part p's sums
    over its range alone, as a weight holding those blocks alone gives them (a tensor-parallel
    rank's share of the experts' down projection), in one call."""
    groups = groups.to(torch.int64).contiguous()
    n, k = experts.shape[-2:]
    parts = k_parts or [range(k)]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, the weight {k}")
    check_k_parts(parts, k, experts.qtype)
    y = torch.empty(len(parts), x.shape[0], n, dtype=torch.float32)
    if supported(experts.qtype):
        rows = x.float().contiguous()
        data = blocks(experts)
        cuts = (ctypes.c_int64 * (len(parts) + 1))(*(r.start for r in parts), k)
        _kernel().quant_gemm(isa(), int(experts.qtype), rows.data_ptr(), rows.stride(0), data.data_ptr(),
                             data.stride(0), data.stride(1), y.data_ptr(), y.stride(1),
                             groups.data_ptr(), groups.shape[0], k, n, len(parts), cuts, y.stride(0))
    else:
        full = dequantize(experts)
        for expert, first, count in groups.tolist():
            for p, r in enumerate(parts):
                y[p, first:first + count] = x[first:first + count, r.start:r.stop].float() @ full[expert, :, r.start:r.stop].T
    y = y.to(x.dtype)
    return y if k_parts else y[0]


def from_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """gpt-oss's HF MXFP4 weight (blocks [..., N, G, 16] uint8, consecutive values in a byte's low
    then high nibble; scales [..., N, G] E8M0 bytes; see mxfp4.py) as GGUF MXFP4 blocks: per block
    the scale byte, then 16 bytes holding values 0-15 in the low nibbles and 16-31 in the high."""
    blocks = blocks.to(torch.uint8)
    values = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32]
    packed = values[..., :16] | (values[..., 16:] << 4)
    data = torch.cat([scales.to(torch.uint8)[..., None], packed], dim=-1).flatten(-2).contiguous()
    shape = (*blocks.shape[:-2], blocks.shape[-2] * 32)
    return QuantizedWeight(GGMLQuantizationType.MXFP4, data, shape)


def random_weight(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int = 0,
                  e8m0: tuple[int, int] = (112, 136)) -> QuantizedWeight:
    """Random valid blocks for tests and benchmarks: random quants and packed scales, finite
    float16 scales around 0.02, MXFP4 scale bytes drawn from `e8m0` (low, high exclusive)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    data = rng.integers(0, 256, size=(rows, shape[-1] // block, size), dtype=np.uint8)
    if qtype == GGMLQuantizationType.MXFP4:
        data[..., 0] = rng.integers(*e8m0, size=data.shape[:2])
    for offset in _HALF_SCALES.get(qtype, ()):
        scale = (rng.standard_normal(data.shape[:2]) * 0.02).astype(np.float16)
        data[..., offset:offset + 2] = scale.view(np.uint8).reshape(*data.shape[:2], 2)
    blocks = torch.from_numpy(data).view(*shape[:-1], -1)
    return QuantizedWeight(qtype, blocks, tuple(shape))
