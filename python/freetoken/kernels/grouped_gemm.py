"""The kernels of csrc/grouped_gemm.c, built at first use (build.py) and called through
ctypes. The grouped GEMM runs the MoE experts (layers/moe.py: one call per projection
for all of a layer's experts) and, where the load-time probe picks it, the dense layers
(layers/linear.py: one group each); `rms_norm` and `rotate` run layers/norm.py's RMSNorm
and rotary.py's rotation, `add_rms_norm`, `norm_rotate` and `silu_mul` a layer's residual add
and norm, its q/k norms and rotation, and its SwiGLU, in one call each. (bfloat16 linears on the
CPU's bfloat16 units: bf16_linear.py.)

Why our own kernel: a decode step gives each active expert a few rows, and torch's CPU GEMMs
(oneDNN and MKL alike) read an expert's weights at about half the memory bandwidth one core
reaches on a plain sum, and split a small GEMM poorly over threads (scripts/bench_engine.py
--tables moe measures both paths). The kernel streams each weight strip once for all of its
rows and is batch-invariant by construction (see the C file), so its rows need no padding.

Weights are read as float32 or bfloat16 (widened exactly), rows and sums are float32: a
bfloat16 model reads half the bytes and accumulates as a float32 GEMM does. Where it cannot be
used (no C compiler, not x86-64 with AVX2/FMA, another dtype, not a CPU tensor, or
FREETOKEN_NO_KERNELS set), `load()` returns None and the layers run on torch's kernels; the
server logs why (kernels/plan.py records it)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from freetoken.kernels import build

# moe_route_f32's modes (kernels.h)
ROUTES = {name: value for name, value in build.declarations().enums.items() if name.startswith("ROUTE_")}

SOURCE = build.source("grouped_gemm")
STRIP = 16


# The weight dtypes the kernel reads (as the C function's suffix).
KERNELS = {torch.float32: "f32", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class PackedLinears:
    """Same-shaped linear layers (one projection of a layer's experts, or one dense layer) in the
    kernel's layout."""

    weight: torch.Tensor  # [E, strips, K, 16], float32 or bfloat16 as the model's
    bias: torch.Tensor | None  # [E, strips * 16] float32, zero past N
    in_features: int
    out_features: int


def pack(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> PackedLinears:
    """Per-expert nn.Linear weights ([N, K] each, one dtype of KERNELS) and biases ([N] or None)
    in strips of 16 output columns."""
    n, k = weights[0].shape
    strips = -(-n // STRIP)
    stacked = torch.zeros(len(weights), strips * STRIP, k, dtype=weights[0].dtype)
    for e, w in enumerate(weights):
        stacked[e, :n] = w
    packed = stacked.view(len(weights), strips, STRIP, k).transpose(2, 3).contiguous()
    bias = None
    if biases[0] is not None:
        bias = torch.zeros(len(weights), strips * STRIP, dtype=torch.float32)
        for e, b in enumerate(biases):
            bias[e, :n] = b
    return PackedLinears(packed, bias, k, n)


def grouped_gemm(lib: ctypes.CDLL, x: torch.Tensor, experts: PackedLinears,
                 groups: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, K] (rows grouped by expert); groups [G, 3] int64 (expert, first row, row count),
    covering every row of x, or None: all rows through the first layer; returns [R, N] in x's
    dtype, accumulated in float32."""
    rows = x.float().contiguous()
    if groups is None:
        groups = torch.tensor([[0, 0, rows.shape[0]]], dtype=torch.int64)
    assert groups.is_contiguous() and groups.dtype == torch.int64
    y = torch.empty(rows.shape[0], experts.out_features, dtype=torch.float32)
    bias = experts.bias.data_ptr() if experts.bias is not None else None
    kernel = getattr(lib, f"grouped_gemm_{KERNELS[experts.weight.dtype]}")
    kernel(rows.data_ptr(), rows.stride(0), experts.weight.data_ptr(), bias, y.data_ptr(),
           y.stride(0), groups.data_ptr(), groups.shape[0], experts.in_features,
           experts.out_features)
    return y.to(x.dtype)


@cache
def load() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot run here (logged once)."""
    return build.open_library("grouped_gemm", "grouped_gemm_supported", "AVX2/FMA", "layers run on torch kernels")


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] (D % 8 == 0, a dtype of KERNELS) by weight [D] of x's dtype, each
    row in one pass (grouped_gemm.c's rms_norm_*)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=x.dtype)
    getattr(lib, f"rms_norm_{KERNELS[x.dtype]}")(rows.data_ptr(), rows.stride(0), weight.data_ptr(),
                                                 y.data_ptr(), rows.shape[0], rows.shape[1], eps)
    return y.view(x.shape)


def rotate(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (D % 16 == 0, the last dim contiguous, a dtype of KERNELS) turned by cos and sin
    [T, 1, D] of x's dtype, contiguous (grouped_gemm.c's rotate_*): torch's bits, in one pass."""
    tokens, heads, dim = x.shape
    y = torch.empty(tokens, heads, dim, dtype=x.dtype)
    getattr(lib, f"rotate_{KERNELS[x.dtype]}")(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(),
                                               sin.data_ptr(), y.data_ptr(), tokens, heads, dim)
    return y


def add_rms_norm(lib: ctypes.CDLL, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """x += delta in place, then RMSNorm of x by weight (x, delta [M, D], D % 8 == 0, the last dim
    contiguous, one dtype of KERNELS as weight's), each row in one pass (add_rms_norm_*)."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    getattr(lib, f"add_rms_norm_{KERNELS[x.dtype]}")(
        x.data_ptr(), x.stride(0), delta.data_ptr(), delta.stride(0), weight.data_ptr(), y.data_ptr(),
        x.shape[0], x.shape[1], eps)
    return y


def norm_rotate(lib: ctypes.CDLL, x: torch.Tensor, split: int, weights: tuple[torch.Tensor, ...] | None,
                eps: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [T, H, D] (D % 16 == 0, the last dim contiguous, a dtype of KERNELS) in place: each head
    RMS-normed by weights[0] (heads before `split`) or weights[1] (None: no norm), then turned by
    cos and sin [T, 1, D] of x's dtype, contiguous (norm_rotate_*)."""
    tokens, heads, dim = x.shape
    wq, wk = (weights[0].data_ptr(), weights[1].data_ptr()) if weights else (None, None)
    getattr(lib, f"norm_rotate_{KERNELS[x.dtype]}")(
        x.data_ptr(), x.stride(0), x.stride(1), tokens, heads, split, wq, wk, eps, cos.data_ptr(),
        sin.data_ptr(), dim)


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [M, 2 * half] ([gate | up], half % 8 == 0, the last dim
    contiguous, a dtype of KERNELS), each element as torch's vectorised ops compute it (silu_mul_*)."""
    rows, half = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(rows, half, dtype=gate_up.dtype)
    getattr(lib, f"silu_mul_{KERNELS[gate_up.dtype]}")(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(),
                                                       rows, half)
    return y


def moe_sum(lib: ctypes.CDLL, down: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor | None,
            tokens: int) -> torch.Tensor:
    """[tokens, H] float32: token t's k rows of down [tokens * k, H] (rows slots[t * k:(t + 1) * k],
    or t * k onwards where slots is None), each times its scale [tokens * k, 1], summed from zero in
    slot order, a product rounded before its add (moe_sum_f32: torch's mul_ then add_ a slot)."""
    rows, hidden = down.shape
    down, scale = down.contiguous(), scale.contiguous()
    slots = None if slots is None else slots.to(torch.int64).contiguous()
    y = torch.empty(tokens, hidden, dtype=torch.float32)
    lib.moe_sum_f32(down.data_ptr(), hidden, scale.data_ptr(), None if slots is None else slots.data_ptr(),
                    tokens, rows // tokens, hidden, y.data_ptr())
    return y


def moe_route(lib: ctypes.CDLL, logits: torch.Tensor, k: int, mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE route of logits [T, E] (any float dtype, widened) in one call (moe_route_f32, `mode`
    one of ROUTES: Qwen-MoE's softmax then the k largest, renormalised or not, or gpt-oss's k
    largest logits then a softmax over them; a tie to the lower id): weights [T, k] float32,
    expert ids [T, k] int64, in descending order."""
    rows = logits.float().contiguous()
    tokens, experts = rows.shape
    if not 0 < k <= experts:
        raise ValueError(f"top {k} of {experts} experts")
    weights = torch.empty(tokens, k, dtype=torch.float32)
    ids = torch.empty(tokens, k, dtype=torch.int64)
    lib.moe_route_f32(rows.data_ptr(), experts, tokens, experts, k, mode, weights.data_ptr(), ids.data_ptr())
    return weights, ids


def clamped_swiglu(lib: ctypes.CDLL, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of float32 gate_up [M, 2 * half] ([gate | up], half % 8 == 0, the last
    dim contiguous) in one pass (clamped_swiglu_f32): [M, half]."""
    rows, half = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(rows, half, dtype=torch.float32)
    lib.clamped_swiglu_f32(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), rows, half, alpha, limit)
    return y
