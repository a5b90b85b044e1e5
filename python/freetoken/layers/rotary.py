"""Rotary embedding: the frequencies (the default schedule, YaRN for gpt-oss and long-context
Qwen releases, Llama 3.1's `llama3`, Phi-3's `longrope`, the `linear` one of Gemma 3's global
layers: every frequency divided by the factor), the angles' cos and sin, and the rotation of q
and k.

YaRN blends, per frequency, the original angle (fast dimensions, extrapolated) with the angle
divided by `factor` (slow dimensions, interpolated) along a linear ramp between the dimensions
that turn `beta_fast` and `beta_slow` times over the original context, and scales cos and sin
by an attention factor (0.1 ln(factor) + 1 unless the config gives one; DeepSeek's `mscale` and
`mscale_all_dim`: the ratio of that term at each), as the YaRN paper and transformers'
`rope_type="yarn"` do.

`llama3` divides the frequencies whose wavelength exceeds original / low_freq_factor by
`factor`, keeps those shorter than original / high_freq_factor, and blends the two between, as
transformers' `rope_type="llama3"` does, op for op (the same bits).

`longrope` divides each frequency by its own factor and scales cos and sin by
sqrt(1 + ln(factor) / ln(original)), factor the context over the original one. transformers
takes the short factors while a sequence fits the original context and, once it outgrows it,
recomputes the whole sequence with the long ones; a KV cache cannot, so the engine serves such
a model within its original context (config.native_context), on the short factors.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from functools import cache

import torch

from freetoken.kernels.grouped_gemm import KERNELS
from freetoken.kernels.grouped_gemm import norm_rotate as norm_rotate_kernel
from freetoken.kernels.grouped_gemm import rotate as rotate_kernel
from freetoken.kernels.plan import available
from freetoken.layers.norm import RMSNorm


@dataclass(frozen=True)
class Yarn:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    @classmethod
    def from_hf(cls, rope: dict, max_position_embeddings: int) -> Yarn:
        original = rope["original_max_position_embeddings"]
        factor = rope.get("factor") or max_position_embeddings / original
        scale = rope.get("attention_factor")
        if scale is None and rope.get("mscale") and rope.get("mscale_all_dim"):
            scale = yarn_mscale(factor, rope["mscale"]) / yarn_mscale(factor, rope["mscale_all_dim"])
        return cls(factor=factor, original_max_position_embeddings=original,
                   beta_fast=rope.get("beta_fast") or 32.0, beta_slow=rope.get("beta_slow") or 1.0,
                   truncate=rope.get("truncate", True), attention_factor=scale)

    def frequencies(self, dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, float]:
        pos_freqs = base ** _exponent(dim, device)
        extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        low = _correction_dim(self.beta_fast, dim, base, self.original_max_position_embeddings)
        high = _correction_dim(self.beta_slow, dim, base, self.original_max_position_embeddings)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a one-point ramp would divide by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: the original angle, 0: the interpolated one
        inv_freq = interpolated * (1 - keep) + extrapolated * keep
        return inv_freq, yarn_mscale(self.factor) if self.attention_factor is None else self.attention_factor


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale of a context `factor` times the trained one: 0.1 mscale ln(factor) + 1."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


@dataclass(frozen=True)
class Llama3:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def from_hf(cls, rope: dict, max_position_embeddings: int) -> Llama3:
        return cls(factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                   high_freq_factor=rope["high_freq_factor"],
                   original_max_position_embeddings=rope["original_max_position_embeddings"])

    def frequencies(self, dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, float]:
        inv_freq = 1.0 / (base ** _exponent(dim, device))
        original, low, high = self.original_max_position_embeddings, self.low_freq_factor, self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / self.factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, smoothed, scaled), 1.0


@dataclass(frozen=True)
class LongRope:
    short_factor: tuple[float, ...]
    attention_factor: float

    @classmethod
    def from_hf(cls, rope: dict, max_position_embeddings: int) -> LongRope:
        original = rope["original_max_position_embeddings"]
        factor = rope.get("factor") or max_position_embeddings / original
        scale = rope.get("attention_factor")
        if scale is None:
            scale = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        return cls(short_factor=tuple(rope["short_factor"]), attention_factor=scale)

    def frequencies(self, dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, float]:
        factors = torch.tensor(self.short_factor, dtype=torch.float32, device=device)
        return 1.0 / (factors * base ** _exponent(dim, device)), self.attention_factor


@dataclass(frozen=True)
class LinearScaling:
    factor: float

    @classmethod
    def from_hf(cls, rope: dict, max_position_embeddings: int) -> LinearScaling:
        return cls(factor=rope["factor"])

    def frequencies(self, dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, float]:
        return 1.0 / (base ** _exponent(dim, device)) / self.factor, 1.0


# The scaled schedules, by the rope_type naming each (none: the default schedule).
SCHEDULES = {"yarn": Yarn, "llama3": Llama3, "longrope": LongRope, "linear": LinearScaling}
Schedule = Yarn | Llama3 | LongRope | LinearScaling


def _correction_dim(rotations: float, dim: int, base: float, context: int) -> float:
    """The dimension whose angle turns `rotations` times over `context` positions."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def _exponent(dim: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim


@cache  # every step asks for the same few; the tensor is only read
def rope_frequencies(dim: int, base: float, scaling: Schedule | None,
                     device: torch.device) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] in fp32, and the factor cos and sin are scaled by."""
    if scaling is None:
        return 1.0 / (base ** _exponent(dim, device)), 1.0
    return scaling.frequencies(dim, base, device)


def cos_sin(positions: torch.Tensor, dim: int, base: float, scaling: Schedule | None,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, dim] of the positions' angles (broadcast over heads), computed in fp32
    whatever `dtype`, as transformers computes them."""
    inv_freq, scale = rope_frequencies(dim, base, scaling, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lib: ctypes.CDLL | None = NotImplemented
           ) -> torch.Tensor:
    """x [..., dim] turned by the angles of `cos_sin` (halves rotated, as transformers does), its
    first cos.shape[-1] dims only (partial rotary), the rest as they are: in one pass where the
    caller's kernel plan gives `lib` (grouped_gemm.c's; None: torch's ops; unplanned: this
    process's, `rotary_kernel`), with torch's bits."""
    if lib is NotImplemented:
        lib = rotary_kernel(x.dtype, x.device)
    turned = cos.shape[-1]
    if turned < x.shape[-1]:
        return torch.cat([rotate(x[..., :turned], cos, sin, lib), x[..., turned:]], dim=-1)
    if lib is not None and _fits(x, cos, sin):
        return rotate_kernel(lib, x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def norm_rotate(qk: torch.Tensor, split: int, norms: tuple[RMSNorm, RMSNorm] | None, cos: torch.Tensor | None,
                sin: torch.Tensor | None, lib: ctypes.CDLL | None = NotImplemented) -> torch.Tensor:
    """Attention's query and key heads qk [T, heads, dim] (the first `split` q's), each RMS-normed
    by its norm of `norms` (q's, k's; None: not normed), then turned by the angles of `cos_sin`
    (None: not turned): where the kernel plan gives `lib` (see `rotate`), in place in one pass
    with the bits of the separate steps; returns the result."""
    if lib is NotImplemented:
        lib = rotary_kernel(qk.dtype, qk.device)
    fused = lib if cos is not None and _fits(qk, cos, sin) else None
    if fused is not None and (norms is None or (
            norms[0].kernel(qk) is not None and norms[0].eps == norms[1].eps
            and norms[0].weight.dtype == norms[1].weight.dtype)):
        weights = None if norms is None else (norms[0].weight, norms[1].weight)
        norm_rotate_kernel(fused, qk, split, weights, norms[0].eps if norms else 0.0, cos, sin)
        return qk
    if norms is not None:
        qk = torch.cat([norms[0](qk[:, :split]), norms[1](qk[:, split:])], dim=1)
    return qk if cos is None else rotate(qk, cos, sin, lib)


def rotary_kernel(dtype: torch.dtype, device: torch.device | str) -> ctypes.CDLL | None:
    """The plan's choice for rotating rows of `dtype` on `device`: grouped_gemm.c's where it runs
    them, else None (kernels/plan.py)."""
    return available().elementwise(dtype, device)


def rotary_name(lib: ctypes.CDLL | None, dtype: torch.dtype, fused: str = "rotate") -> str:
    """The plan's name of a rotation on `lib` (fused: norm_rotate, the q/k norms with it)."""
    return f"grouped_gemm.c {fused}_{KERNELS[dtype]}" if lib is not None else "torch"


def _fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Do x [T, H, D], cos and sin meet rotate_*'s contract (D % 16 == 0, one dtype, the last dim
    contiguous, cos and sin [T, 1, D] contiguous)?"""
    return (x.dim() == 3 and x.dtype in KERNELS and x.dtype == cos.dtype and x.shape[-1] % 16 == 0
            and x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape == sin.shape == (x.shape[0], 1, x.shape[-1]))
