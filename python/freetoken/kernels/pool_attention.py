"""Attention read straight from the KV pool by slot (csrc/pool_attention.c, built at first use by
build.py), for layers/attention.py's prompt and decoding rows.

The torch path copies every request's keys and values out of the pool (`index_select`) each
layer and step, and pads a decode's queries for SDPA's rounding; the kernel reads each key where
it lies, and computes every row alone in a fixed order, so a row's bits never depend on its batch
(see the C file). Where it cannot run (no C compiler, not x86-64 with AVX2/FMA, a cache dtype
other than float32/bfloat16, a tensor off the CPU, or FREETOKEN_NO_KERNELS set), the kernel plan
(kernels/plan.py) keeps the layer on the torch path. `attend_latent` reads multi-head latent attention's cache (layers/mla.py)
by the same code: one kv head, a slot's whole row its key and the row's first elements its value.
"""

from __future__ import annotations

import ctypes
import math
from functools import cache

import torch

from freetoken.kernels import build

KERNELS = {torch.float32: "f32", torch.bfloat16: "bf16"}


@cache
def load() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot run here (logged once)."""
    lib = build.open_library("pool_attention", "pool_attention_supported", "AVX2/FMA",
                             "attention runs on torch's SDPA")
    if lib is not None:
        lib.pool_attention_set_isa(2)  # AVX-512 where the CPU has it: the same bits as AVX2
    return lib


def softmax_scale(dim: int, scale: float | None) -> float:
    """The factor of the scores: `scale`, or 1 / sqrt(dim) where None (SDPA's default)."""
    return 1.0 / math.sqrt(dim) if scale is None else scale


def attend(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, ranges: torch.Tensor,
           sinks: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Queries q [R, heads, D] over a contiguous CPU cache [slots, 2 * kv heads, D] (D % 8 == 0,
    a dtype of KERNELS; where the kernel plan put a layer on it): row r's keys are
    slots[first + j] for j in [lo, hi), ranges [R, 3] int64 = (first, lo, hi), slots int64.
    `sinks`: float32 [heads] logits the softmax counts with no value, or None; `scale`: see
    `softmax_scale`. Returns q's dtype."""
    rows, heads, dim = q.shape
    q32 = q.float().contiguous()
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    assert slots.dtype == ranges.dtype == torch.int64 and slots.is_contiguous() and ranges.is_contiguous()
    kernel = getattr(load(), f"pool_attention_{KERNELS[kv_cache.dtype]}")
    kernel(q32.data_ptr(), kv_cache.data_ptr(), slots.data_ptr(), ranges.data_ptr(),
           sinks.data_ptr() if sinks is not None else None, out.data_ptr(), rows, heads,
           kv_cache.shape[1] // 2, dim, softmax_scale(dim, scale))
    return out.to(q.dtype)


def attend_latent(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, ranges: torch.Tensor, latent: int,
                  scale: float | None) -> torch.Tensor:
    """As `attend`, over a multi-head latent attention cache [slots, 1, D] (D and `latent`
    multiples of 8): queries q [R, heads, D] against each row whole, softmax-weighted sums of its first `latent` elements, [R, heads, latent] in q's dtype."""
    rows, heads, dim = q.shape
    q32 = q.float().contiguous()
    out = torch.empty(rows, heads, latent, dtype=torch.float32)
    assert slots.dtype == ranges.dtype == torch.int64 and slots.is_contiguous() and ranges.is_contiguous()
    kernel = getattr(load(), f"pool_attention_{KERNELS[cache.dtype]}_latent")
    kernel(q32.data_ptr(), cache.data_ptr(), slots.data_ptr(), ranges.data_ptr(), out.data_ptr(), rows, heads,
           dim, latent, softmax_scale(dim, scale))
    return out.to(q.dtype)
