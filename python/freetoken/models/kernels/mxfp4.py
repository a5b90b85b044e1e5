"""MXFP4 weights, as gpt-oss releases its experts: dequantised once at load.

A block of 32 weights is 16 bytes of FP4 (e2m1) values, two per byte with the low nibble
first, sharing one E8M0 scale byte, 2**(scale - 127) (the OCP microscaling format). Every such
value is exact in bfloat16 (1 mantissa bit, an 8-bit exponent like float32's), so dequantising
to bfloat16 loses nothing and takes half the memory of float32.
"""

from __future__ import annotations

import torch

# e2m1 codes 0-15: sign bit, 2 exponent bits, 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> weights [..., G * 32] in `dtype`."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8).int()
    values = torch.stack([lut[blocks & 0x0F], lut[blocks >> 4]], dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)
