"""Attention over the engine's KV pool, in the step's groups (kvcache/forward_context.py).

q/k/v are one fused projection (`qkv_proj`, rows [q heads | k heads | v heads]); per-head q/k
RMSNorm (Qwen3), q/k/v biases (Qwen2), an o_proj bias, sliding-window layers and layers without
rotary embedding (SmolLM3) are config fields. A family changes the softmax by overriding `_sdpa` and `_sink_logits` (gpt-oss's sinks)
or the projections by overriding `forward` (the hybrids' gated attention), and reuses `_attend`;
multi-head latent attention (layers/mla.py) its pool's layout too (`_keys_values`, `_pool_kernel`,
`_on_pool`), and reuses `_attend_cached`.

Prompt and decoding rows attend through kernels/pool_attention.py where the kernel plan put them
(kernels/plan.py: a CPU cache of float32 or bfloat16, where the kernel runs): it reads the keys
where they lie in the pool and computes each row alone, so a row's bits depend neither on its
batch nor on whether it came as a prompt or a decoding row; elsewhere torch's SDPA over the
group's gathered keys (forward_context.py's groups keep its rows batch-invariant).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kvcache.forward_context import DecodeGroup, ForwardContext, PromptGroup
from freetoken.kernels import pool_attention
from freetoken.kernels.plan import DTYPES, Available, available
from freetoken.layers.linear import Linear
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import norm_rotate, rotary_name

# CPU attention kernels round a row differently when a call has fewer than 4 queries per head:
# on SDPA, a decoding request's queries per kv head are padded to 4 by repeating the last one.
MIN_QUERY_ROWS = 4


class Attention(nn.Module):
    sliding = False  # a sliding-window layer (subclasses with their own __init__ have none)
    rotary = True  # q and k turned by the rotary embedding (not in SmolLM3's NoPE layers)
    scale: float | None = None  # of the scores; None: 1 / sqrt(head_dim) (Granite's is its own)
    # kernels/decoder_layer.c's call computes this attention as it runs (q/k/v, q/k norms, rotation,
    # the pool kernel with `_sink_logits`, o); a family that changes more says no.
    in_one_call = True
    # Chosen once by `plan_kernels` (kernels/plan.py; a layer built outside a load: at its first
    # step): grouped_gemm.c's library for the rotation (None: torch's ops), and whether the rows
    # attend on pool_attention.c (else torch's SDPA).
    rotary_lib: ctypes.CDLL | None = NotImplemented
    pool: bool = NotImplemented

    def __init__(self, cfg, layer: int):
        """`cfg`: models/llama.py's ModelConfig, or a family's with its attention fields."""
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, d, heads, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.qkv_proj = Linear(h, (heads + 2 * kvh) * d, bias=cfg.attention_bias)
        self.o_proj = Linear(heads * d, h, bias=cfg.o_proj_bias)
        self.sliding = layer in cfg.sliding_layers
        self.rotary = layer not in cfg.unrotated_layers
        self.scale = cfg.attention_scale
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def plan_kernels(self, kernels: Available, dtype: torch.dtype, device: torch.device | str) -> dict[str, str]:
        """kernels/plan.py's question: the rotation's kernel and the attention's, for rows and a
        KV pool of `dtype` on `device`."""
        self.rotary_lib = kernels.elementwise(dtype, device)
        self.pool = kernels.attention is not None and self._pool_kernel(dtype, device)
        qk_norm = getattr(self.cfg, "qk_norm", False)
        return {"rotary": rotary_name(self.rotary_lib, dtype, "norm_rotate" if qk_norm else "rotate"),
                "attention": f"pool_attention.c ({DTYPES[dtype]} pool)" if self.pool else "torch SDPA"}

    def planned(self, x: torch.Tensor) -> None:
        """Plan a layer built outside a load (a test's), at its first step."""
        if self.pool is NotImplemented:
            self.plan_kernels(available(), x.dtype, x.device)

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        self.planned(x)
        cfg, t = self.cfg, x.shape[0]
        heads, kvh = cfg.num_heads, cfg.num_kv_heads
        qkv = self.qkv_proj(x).view(t, heads + 2 * kvh, cfg.head_dim)
        norms = (self.q_norm, self.k_norm) if cfg.qk_norm else None
        qk = norm_rotate(qkv[:, : heads + kvh], heads, norms, *((cos, sin) if self.rotary else (None, None)),
                         self.rotary_lib)
        out = self._attend(qk[:, :heads], qk[:, heads:], qkv[:, heads + kvh :], ctx)
        return self.o_proj(out.reshape(t, -1))

    def _attend(self, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        """Store the step's keys and values [T, kv heads, d] in the pool, then attend the
        queries [T, heads, d] in the step's groups."""
        return self._attend_cached(q, self.store(k, v, ctx), ctx)

    def _attend_cached(self, q, kv_cache, ctx: ForwardContext, width: int | None = None) -> torch.Tensor:
        """The queries [T, heads, d] over the layer's cache in the step's groups: [T, heads,
        `width`] (None: d), each head's weighted values."""
        out = q.new_zeros(*q.shape[:2], width or q.shape[-1])
        for group in ctx.prompt_groups:
            out.index_copy_(0, group.out_rows, self._prompt(q, kv_cache, group))
        for group in ctx.decode_groups:
            out.index_copy_(0, group.rows, self._decode(q.index_select(0, group.rows), kv_cache, group))
        return out

    def store(self, k, v, ctx: ForwardContext) -> torch.Tensor:
        """Write the step's keys and values at ctx.out_slots; returns the layer's cache."""
        kv_cache = ctx.kv_cache[self.layer]
        kv_cache.index_copy_(0, ctx.out_slots, torch.cat([k, v], dim=1).to(kv_cache.dtype))
        return kv_cache

    def _prompt(self, q, kv_cache, group: PromptGroup) -> torch.Tensor:
        if group.key_ranges is not None and self.pool:
            ranges = group.window_key_ranges if self.sliding else group.key_ranges
            return self._on_pool(q.index_select(0, group.out_rows), kv_cache, group.kv_slots, ranges)
        cfg = self.cfg
        b, _, length = group.shape
        # index_select, not kv_cache[slots]: advanced indexing copies several times slower.
        q = q.index_select(0, group.query_rows).view(b, -1, cfg.num_heads, cfg.head_dim)
        k, v = self._keys_values(kv_cache.index_select(0, group.kv_slots).view(b, length, -1))
        mask = group.window_mask if self.sliding else group.mask
        attn = self._sdpa(q.transpose(1, 2), k, v, mask, folded=False)
        return attn.transpose(1, 2).reshape(-1, cfg.num_heads, attn.shape[-1]).index_select(0, group.kept)

    def _decode(self, q, kv_cache, group: DecodeGroup) -> torch.Tensor:
        if group.key_ranges is not None and self.pool:
            ranges = group.window_key_ranges if self.sliding else group.key_ranges
            return self._on_pool(q, kv_cache, group.kv_slots, ranges)
        cfg, b = self.cfg, q.shape[0]
        per_kv_head = cfg.num_heads // cfg.num_kv_heads
        q = q.view(b, cfg.num_kv_heads, per_kv_head, cfg.head_dim)
        if per_kv_head < MIN_QUERY_ROWS:
            q = torch.cat([q, q[:, :, -1:].expand(-1, -1, MIN_QUERY_ROWS - per_kv_head, -1)], dim=2)
        k, v = self._keys_values(kv_cache.index_select(0, group.kv_slots).view(b, -1, kv_cache[0].numel()))
        valid = group.window_valid if self.sliding else group.valid
        attn = self._sdpa(q, k, v, valid, folded=True)
        return attn[:, :, :per_kv_head].reshape(b, cfg.num_heads, attn.shape[-1])

    def _keys_values(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [B, kv heads, L, d] of the pool's rows [B, L, row] gathered for SDPA."""
        kvh = self.cfg.num_kv_heads
        kv = rows.view(*rows.shape[:2], 2 * kvh, -1).permute(0, 2, 1, 3)
        return kv[:, :kvh], kv[:, kvh:]

    def _pool_kernel(self, dtype: torch.dtype, device: torch.device | str) -> bool:
        """Can kernels/pool_attention.py (`_on_pool`) read this layer's pool, [slots, 2 * kv heads,
        head_dim] of `dtype` on `device` (the engine's pool: contiguous)?"""
        return torch.device(device).type == "cpu" and dtype in DTYPES and self.cfg.head_dim % 8 == 0

    def _on_pool(self, q, kv_cache, slots, ranges) -> torch.Tensor:
        """Queries q [R, heads, d] over the pool, row r's keys as pool_attention.attend reads them."""
        return pool_attention.attend(q, kv_cache, slots, ranges, self._sink_logits(), self.scale)

    def _sink_logits(self) -> torch.Tensor | None:
        """float32 [heads]: per-head logits the softmax also counts, with no value (gpt-oss's
        sinks), for the pool kernel; None: a plain softmax."""
        return None

    def _sdpa(self, q, k, v, mask: torch.Tensor | None, folded: bool) -> torch.Tensor:
        """SDPA over q [B, heads, Q, d] and k, v [B, kv heads, L, d], causal when `mask` is
        None. `folded`: a decode call, whose q is [B, kv heads, rows, d] with each kv head's
        query heads as rows (padded by repeating the last)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=not folded, scale=self.scale)
