"""Elementwise functions whose bits do not depend on where a row sits in its tensor.

torch's CPU loops run an elementwise op in vectors of up to 64 bytes, two at a time, and the
elements left over at the end of a thread's share (fewer than two vectors) through a scalar
path: for transcendental functions (exp, sigmoid, softplus, SiLU) the vector code and the
scalar code round differently. Which elements of a row fall into that tail depends on the
tensor's size and the row's offset in it, so on a tensor of a step's rows a narrow row's value
depends on its batch (seen on the hybrids' gates, [tokens, heads] with 4-32 heads).

`lanewise` runs such a function over rows padded to a multiple of 64 elements (whole vector
pairs for float32 and bfloat16 on AVX-512, AVX2 and NEON) in calls small enough for torch to run
on one thread (below its parallel grain of 32768 elements), so that every element takes the
vector path. Wide tensors whose rows are multiples of 64 elements need no padding, only an even
split: the layers' own widths are. The gated activations run lanewise too: a tensor-parallel
rank's share of a feed-forward width need not be such a multiple (distributed/parts.py).
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch
import torch.nn.functional as F

from freetoken.kernels.grouped_gemm import KERNELS, silu_mul
from freetoken.kernels.grouped_gemm import clamped_swiglu as grouped_clamped_swiglu
from freetoken.kernels.plan import available

LANES = 64
GRAIN = 32768  # at::internal::GRAIN_SIZE: elements below which an op runs on one thread


def lanewise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise `fn`, each element computed as by the vector path."""
    if x.device.type != "cpu":
        return fn(x)
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    padded = F.pad(rows, (0, -width % LANES))
    block = max(1, GRAIN // padded.shape[1])
    out = torch.cat([fn(part) for part in padded.split(block)]) if len(padded) > block else fn(padded)
    return out[:, :width].reshape(*x.shape[:-1], -1)


def silu_and_mul(gate_up: torch.Tensor, lib: ctypes.CDLL | None = NotImplemented) -> torch.Tensor:
    """SwiGLU over a fused projection whose first half is the gate (Llama, Qwen): in one pass
    where the caller's kernel plan gives `lib` (grouped_gemm.c's silu_mul_*, torch's vector
    path's bits; None: torch's ops; unplanned: this process's, kernels/plan.py)."""
    if lib is NotImplemented:
        lib = available().elementwise(gate_up.dtype, gate_up.device)
    half = gate_up.shape[-1] // 2
    if (lib is not None and gate_up.dim() == 2 and gate_up.dtype in KERNELS and half % 8 == 0
            and gate_up.stride(-1) == 1):
        return silu_mul(lib, gate_up)
    gate, up = gate_up[:, :half], gate_up[:, half:]
    if gate_up.device.type != "cpu" or half % LANES:
        return lanewise(F.silu, gate).mul_(up)
    # No padding needed: lanewise's blocks, each product written in place into the output
    # (no concatenation of a step's [rows, intermediate] halves).
    out = torch.empty_like(up, memory_format=torch.contiguous_format)
    block = max(1, GRAIN // half)
    for start in range(0, len(gate_up), block):
        rows = slice(start, start + block)
        torch.mul(F.silu(gate[rows].contiguous()), up[rows], out=out[rows])
    return out


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float,
                   lib: ctypes.CDLL | None = NotImplemented) -> torch.Tensor:
    """gpt-oss's activation over [gate | up]: gate clamped above, up both ways, then
    (up + 1) * gate * sigmoid(alpha * gate); float32 rows in one pass where the caller's kernel
    plan gives `lib` (grouped_gemm.c's clamped_swiglu_f32, the function kernels/decoder_layer.c's
    call runs; None: torch's ops, lanewise; unplanned: this process's)."""
    if lib is NotImplemented:
        lib = available().elementwise(gate_up.dtype, gate_up.device)
    half = gate_up.shape[-1] // 2
    if (lib is not None and gate_up.dim() == 2 and gate_up.dtype == torch.float32 and half % 8 == 0
            and gate_up.stride(-1) == 1):
        return grouped_clamped_swiglu(lib, gate_up, alpha, limit)
    gate = gate_up[:, :half].clamp(max=limit)
    up = gate_up[:, half:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * lanewise(torch.sigmoid, gate * alpha))


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU over a fused projection whose first half is the gate (Gemma's): GELU's tanh
    approximation (transformers' `gelu_pytorch_tanh`, torch's op) lanewise, times the up half."""
    half = gate_up.shape[-1] // 2
    return lanewise(_gelu_tanh, gate_up[:, :half]).mul_(gate_up[:, half:])


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")
