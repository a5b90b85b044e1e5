"""MXFP4 weights as gpt-oss releases its experts, rewritten into GGUF's MXFP4 blocks, which
models/kernels/quant.py keeps and multiplies.

Both are the OCP microscaling format: blocks of 32 FP4 (e2m1) values sharing one E8M0 scale
byte. The HF release stores a block as 16 bytes, value 2i in the low nibble of byte i and 2i + 1
in its high nibble, its scales in a tensor of their own, a value being e2m1 * 2**(scale - 127).
GGUF (llama.cpp) stores a block as 17 bytes: the scale byte, then value j in the low nibble of
byte j and value j + 16 in its high nibble, with the e2m1 table doubled and the scale halved
(ggml's e8m0_to_fp32_half): the same numbers. The rewrite only moves nibbles, so it is
bit-exact.
"""

from __future__ import annotations

import torch

BLOCK = 32  # weights per scale


def to_gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF blocks [..., G, 16] and scales [..., G] (uint8) -> rows [..., G * 17] uint8 of GGUF
    MXFP4 blocks (a QuantizedWeight's `data`)."""
    blocks = blocks.to(torch.uint8)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32] in order
    packed = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)
    return torch.cat([scales.to(torch.uint8).unsqueeze(-1), packed], dim=-1).flatten(-2)
