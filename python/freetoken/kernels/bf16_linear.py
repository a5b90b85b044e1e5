"""bfloat16 linear layers on the CPU's bfloat16 units (csrc/bf16_linear.c, built at first use by
build.py and called through ctypes): `amx_linear_bf16` on AMX tiles, `dot_linear_bf16` on AVX512-BF16 dot products,
both called through `unit_linear`. Both are candidates of layers/linear.py where the CPU has their unit, both invariant to the row
count by construction (oneDNN's bfloat16 kernels block K by the row count: the probe finds which
row counts agree, and the layer pads and splits its calls to them), and both read the weight as
`pack_pairs` lays it out once at load."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from freetoken.kernels import build

SOURCE = build.source("bf16_linear")
# The kernels by the name layers/linear.py gives them, and the check that the CPU has their unit.
UNITS = {"amx": ("amx_linear_bf16", "amx_bf16_supported"),
         "avx512_bf16": ("dot_linear_bf16", "dot_bf16_supported")}


@cache
def load() -> ctypes.CDLL | None:
    """The built library, or None where it cannot run here (logged once)."""
    return build.open_library("bf16_linear", "bf16_linear_supported", "AMX-BF16 or AVX512-BF16",
                              "bfloat16 layers run on the other kernels")


@cache
def available(unit: str) -> bool:
    """Does this CPU have `unit` (a key of UNITS), and may this process use it (Linux grants AMX
    tiles on request)?"""
    lib = load()
    return lib is not None and bool(getattr(lib, UNITS[unit][1])())


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 [N, K] weight (K % 32 == 0) as both kernels read it: per 32-column strip and
    32-wide k step, two blocks of 16 k pairs by 16 columns, [N/32, K/32, 2, 16, 16, 2]."""
    n, k = weight.shape
    strips = -(-n // 32)
    padded = weight.new_zeros(strips * 32, k)
    padded[:n] = weight
    return padded.view(strips, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def unit_linear(unit: str, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                x: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16 (any M: a row's bits do not depend on it) through a layer packed by
    `pack_pairs` (bias float32 or None), on `unit` (a key of UNITS, `available`)."""
    rows = x.contiguous()
    y = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
    getattr(load(), UNITS[unit][0])(rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                                    bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                    y.stride(0), rows.shape[0], rows.shape[1], out_features)
    return y


def address(unit: str) -> int | None:
    """The C function of `unit` (decoder_layer.c calls it), None where the CPU lacks the unit."""
    return build.address(load(), UNITS[unit][0]) if available(unit) else None


def unpack_columns(packed: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The [len(columns), K] weight rows of output `columns` taken back out of `pack_pairs`' layout
    (output n at (n // 32, :, n % 32 // 16, :, n % 16, :))."""
    return packed[columns // 32, :, columns % 32 // 16, :, columns % 16, :].reshape(len(columns), -1)
