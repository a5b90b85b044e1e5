"""MXFP4 weights as gpt-oss releases its experts, rewritten into GGUF's MXFP4 blocks, which
kernels/quant.py keeps and multiplies (`quant.from_mxfp4_blocks` rewrites them).

Both are the OCP microscaling format: blocks of 32 FP4 (e2m1) values sharing one E8M0 scale
byte. The HF release stores a block as 16 bytes, value 2i in the low nibble of byte i and 2i + 1
in its high nibble, its scales in a tensor of their own, a value being e2m1 * 2**(scale - 127).
GGUF (llama.cpp) stores a block as 17 bytes: the scale byte, then value j in the low nibble of
byte j and value j + 16 in its high nibble, with the e2m1 table doubled and the scale halved
(ggml's e8m0_to_fp32_half): the same numbers. The rewrite only moves nibbles, so it is
bit-exact.
"""

BLOCK = 32  # weights per scale

