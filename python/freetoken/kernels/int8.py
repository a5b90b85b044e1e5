"""The int8-activation arithmetic on GGUF blocks (`--quantized-arithmetic int8`, csrc/int8_gemm.c,
built at first use by build.py like quant_gemm.c): each row of x quantized to int8 per
block of 32 values along K with one float32 scale, multiplied on integer dot products, as
llama.cpp multiplies its Q8_0 / Q8_K rows, in a fixed order per output element, so a row's bits
depend neither on its batch, its thread nor the path (VNNI, AVX2 or scalar). Less exact than
quant.py's float32 products on the dequantized weights (the activations are rounded to 8 bits),
faster where the multiply-adds bind (a prefill). Formats: Q8_0, Q4_K, Q5_K, Q6_K (Q4_K_M's)
and MXFP4 (gpt-oss's experts); a layer with a part in another format runs on quant.py's exact kernel.

The arithmetic is chosen as a model's layers are made, inside `arithmetic()` (the loader's
`--quantized-arithmetic`): `chosen()` tells layers/quantized.py's linears and layers/moe.py's
experts which kernel to keep.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache

import torch
from gguf import GGMLQuantizationType

from freetoken.kernels import build
from freetoken.kernels.quant import QuantizedWeight, QuantParts, blocks, check_k_parts

FORMATS = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
           GGMLQuantizationType.Q6_K, GGMLQuantizationType.MXFP4)
# int8_gemm.c's `path` argument; where a CPU runs several, the highest. Every path gives the same
# bits; AVX512-VNNI's few rows run on 512-bit vectors (1.2-1.4x AVX-VNNI's at 1-2 rows, Zen 5).
PATHS = {"scalar": 0, "avx2": 1, "avx_vnni": 2, "avx512_vnni": 3, "avx512_vbmi": 4}
_ARITHMETIC: ContextVar[str] = ContextVar("quantized_arithmetic", default="exact")


@contextmanager
def arithmetic(mode: str):
    """The layers made inside multiply on `mode`'s kernel (config.QUANTIZED_ARITHMETIC)."""
    token = _ARITHMETIC.set(mode)
    try:
        yield
    finally:
        _ARITHMETIC.reset(token)


def chosen(weights: list[QuantizedWeight]) -> bool:
    """Do layers made now run `weights` on this kernel (int8 asked for, every weight's format)?"""
    return _ARITHMETIC.get() == "int8" and all(supported(w) for w in weights)


@cache
def _kernel() -> ctypes.CDLL | None:
    lib = build.open_library("int8_gemm", "int8_supported", "nothing",
                             "quantized layers run the exact arithmetic")
    if lib is not None:
        lib.paths = lib.int8_paths()  # asked once: CPUID is slow under a hypervisor
    return lib


def runs(path: int) -> bool:
    """Does this CPU run `path` (PATHS)? The scalar path only where the kernel is not built."""
    lib = _kernel()
    return bool((lib.paths if lib is not None else 1) >> path & 1)


def best_path() -> int:
    """The path layers run here: the highest in PATHS this CPU runs."""
    return max(p for p in PATHS.values() if runs(p))


def kernel_name(path: int) -> str:
    """How the kernel plan (kernels/plan.py) names this kernel on `path`."""
    return f"int8_gemm.c ({next(name for name, code in PATHS.items() if code == path)})"


def supported(weight: QuantizedWeight) -> bool:
    return weight.qtype in FORMATS and _kernel() is not None


class Int8Parts:
    """QuantParts (the same arguments: parts each in its own format, biases, K parts) on the int8
    arithmetic; `path` None: the best this CPU runs."""

    name = "int8_linear"

    def __init__(self, parts: list[QuantizedWeight], biases: list[torch.Tensor | None],
                 k_parts: list[range] | None = None, path: int | None = None):
        self.exact = QuantParts(parts, biases, k_parts)  # (its arrays: the kernel reads the same)
        self.k, self.n = self.exact.k, self.exact.n
        self.path = best_path() if path is None else path

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, K] (float32 or bfloat16): [R, sum N_p] in x's dtype."""
        rows = x.float().contiguous()
        if rows.shape[1] != self.k or self.k % 32:
            raise ValueError(f"x has {rows.shape[1]} features, the weight {self.k}")
        y = torch.empty(rows.shape[0], self.n, dtype=torch.float32)
        _kernel().int8_gemm_parts(self.path, *self.exact.args, rows.data_ptr(), rows.stride(0), y.data_ptr(),
                                  self.n, rows.shape[0], self.k)
        return y if x.dtype == torch.float32 else y.to(x.dtype)


def grouped_int8_gemm(x: torch.Tensor, experts: QuantizedWeight, groups: torch.Tensor,
                      path: int | None = None, k_parts: list[range] | None = None) -> torch.Tensor:
    """quant.grouped_quant_gemm on the int8 arithmetic: x [R, K], experts [E, N, K], groups [G, 3]
    int64 (expert, first row, row count) covering every row of x; [R, N] float32, or with
    `k_parts` (whole blocks covering K in order) each part's sums apart [len(k_parts), R, N], as
    its blocks alone give them. `path` None: the best this CPU runs (layers/moe.py passes the one
    it kept)."""
    rows, groups = x.float().contiguous(), groups.to(torch.int64).contiguous()
    n, k = experts.shape[-2:]
    if rows.shape[1] != k or k % 32:
        raise ValueError(f"x has {rows.shape[1]} features, the weight {k}")
    parts = k_parts or [range(k)]
    check_k_parts(parts, k, experts.qtype)
    data = blocks(experts)
    y = torch.empty(len(parts), rows.shape[0], n, dtype=torch.float32)
    cuts = (ctypes.c_int64 * (len(parts) + 1))(*(r.start for r in parts), k)
    _kernel().int8_gemm_grouped(best_path() if path is None else path, int(experts.qtype), rows.data_ptr(),
                                rows.stride(0), data.data_ptr(), data.stride(0), data.stride(1), y.data_ptr(),
                                y.stride(1), groups.data_ptr(), groups.shape[0], rows.shape[0], k, n, len(parts),
                                cuts, y.stride(0))
    return y if k_parts else y[0]
