"""Multi-head latent attention (DeepSeek-V2 / V3) over the engine's KV pool, its up-projections
absorbed.

transformers' MLA compresses each token to a latent c (`kv_a_proj_with_mqa`, then
`kv_a_layernorm`: kv_lora_rank wide) and one rope key k_pe shared by every head
(qk_rope_head_dim), caches those, and up-projects the cached latents at every step
(`kv_b_proj`) into each head's key (qk_nope_head_dim, beside k_pe) and value (v_head_dim). The
pool here holds [c | k_pe] per token and layer, nothing per head, and no step up-projects it:

- scores: q_nope . (W_uk_h c) = (W_uk_h^T q_nope) . c, so each head's query is carried into the
  latent space once (`q_to_latent`) and the scores are [q_latent | q_pe] . [c | k_pe];
- outputs: sum_j p_j (W_uv_h c_j) = W_uv_h (sum_j p_j c_j), so each head attends over the
  latents themselves and its weighted latent is projected to its value width once
  (`latent_to_v`), then `o_proj` as usual.

Attention is then multi-query attention of one kv head, [c | k_pe] its keys and c its values:
the pool attention kernel's latent form (kernels/pool_attention.py, `attend_latent`)
where it runs, else torch's SDPA over the gathered rows (keys and values both the whole row,
the output's latent part kept), in the step's groups as for the other attention layers.
The per-head projections are `HeadLinears`: on the CPU's grouped kernel one call for every
head (`stack_heads`), whose rows never depend on their count, else one probed Linear a head.

The rope dimensions of a checkpoint that pairs them interleaved ((x0, x1), (x2, x3), ...: V2's
complex rotation, V3's `rope_interleave`) are reordered at load (`deinterleave_rope`) to the
halves `rotate` turns: the same rotation, its outputs in transformers' V3 order.
"""

from __future__ import annotations

import ctypes
from functools import partial

import torch
from torch import nn

from freetoken.kvcache.forward_context import ForwardContext
from freetoken.kernels import pool_attention
from freetoken.kernels.grouped_gemm import KERNELS, PackedLinears, grouped_gemm, pack
from freetoken.kernels.plan import available
from freetoken.layers.attention import Attention
from freetoken.layers.kernel_choice import RowRule, probe_weight, rule_holds
from freetoken.layers.linear import Linear
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import rotate

# transformers' q_a_layernorm and kv_a_layernorm take RMSNorm's default, not the config's.
LATENT_NORM_EPS = 1e-6


class HeadLinears(nn.Module):
    """A linear layer per attention head (no bias): x [T, heads, in] -> [T, heads, out]."""

    # Set by `stack`: the heads' weights in the grouped kernel's layout, and the kernel.
    packed: PackedLinears | None = None
    kernel: ctypes.CDLL | None = None

    def __init__(self, heads: int, in_features: int, out_features: int):
        super().__init__()
        self.count, self.out_features = heads, out_features
        self.heads = nn.ModuleList(Linear(in_features, out_features, bias=False) for _ in range(heads))

    def stack(self, kernel: ctypes.CDLL) -> None:
        """Run on the grouped kernel from now on: its packed weights replace the Linears."""
        self.packed = pack([layer.weight for layer in self.heads], [None] * self.count)
        self.kernel, self.heads = kernel, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if self.packed is None:
            return torch.stack([layer(x[:, h]) for h, layer in enumerate(self.heads)], dim=1)
        rows = x.transpose(0, 1).reshape(self.count * t, -1)  # head after head
        groups = torch.tensor([(h, h * t, t) for h in range(self.count)], dtype=torch.int64)
        return grouped_gemm(self.kernel, rows, self.packed, groups).view(self.count, t, -1).transpose(0, 1)


class LatentAttention(Attention):
    """`cfg`: models/deepseek.py's DeepseekConfig. Module names are transformers', but for
    `kv_b_proj`, held as `q_to_latent` and `latent_to_v` (`split_kv_b`), and V2-Lite's `q_proj`
    (no query rank), held as `q_b_proj` over the hidden state (the llama family fuses `q_proj`)."""

    in_one_call = False

    def __init__(self, cfg, layer: int):
        nn.Module.__init__(self)
        self.cfg, self.layer, self.scale = cfg, layer, cfg.attention_scale
        h, heads, bias = cfg.hidden_size, cfg.num_heads, cfg.attention_bias
        q_width = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
        self.q_b_proj = Linear(cfg.q_lora_rank or h, q_width, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.q_to_latent = HeadLinears(heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank)
        self.latent_to_v = HeadLinears(heads, cfg.kv_lora_rank, cfg.v_head_dim)
        self.o_proj = Linear(heads * cfg.v_head_dim, h, bias=bias)

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        nope, latent_width = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        self.planned(x)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)) if cfg.q_lora_rank else x).view(t, cfg.num_heads, -1)
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[:, :latent_width])
        k_pe = rotate(compressed[:, None, latent_width:], cos, sin, self.rotary_lib)
        query = torch.cat([self.q_to_latent(q[..., :nope]), rotate(q[..., nope:], cos, sin, self.rotary_lib)], dim=-1)
        kv_cache = ctx.kv_cache[self.layer]
        kv_cache.index_copy_(0, ctx.out_slots, torch.cat([latent[:, None], k_pe], dim=-1).to(kv_cache.dtype))
        out = self._attend_cached(query, kv_cache, ctx, latent_width if self.pool else None)
        return self.o_proj(self.latent_to_v(out[..., :latent_width]).reshape(t, -1))

    def _keys_values(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # One kv head whose values are its keys: the output's rope part is dropped by forward.
        kv = rows[:, None]
        return kv, kv

    def _pool_kernel(self, dtype: torch.dtype, device: torch.device | str) -> bool:
        """Can `attend_latent` read this layer's pool, [slots, 1, kv_lora_rank + rope dims] of
        `dtype` on `device`, whose values are each row's first kv_lora_rank elements?"""
        cfg = self.cfg
        return (torch.device(device).type == "cpu" and dtype in KERNELS and cfg.kv_lora_rank % 8 == 0
                and (cfg.kv_lora_rank + cfg.qk_rope_head_dim) % 8 == 0)

    def _on_pool(self, q, kv_cache, slots, ranges) -> torch.Tensor:
        return pool_attention.attend_latent(q, kv_cache, slots, ranges, self.cfg.kv_lora_rank, self.scale)


def split_kv_b(state: dict[str, torch.Tensor], prefix: str, heads: int, nope: int) -> None:
    """`prefix`kv_b_proj.weight ([heads * (nope + v), kv_lora_rank]) out of `state`, in place, as
    each head's `q_to_latent` (its key rows, transposed: nope -> latent) and `latent_to_v`."""
    weight = state.pop(f"{prefix}kv_b_proj.weight")
    per_head = weight.view(heads, -1, weight.shape[-1])
    for h in range(heads):
        state[f"{prefix}q_to_latent.heads.{h}.weight"] = per_head[h, :nope].T.contiguous()
        state[f"{prefix}latent_to_v.heads.{h}.weight"] = per_head[h, nope:].contiguous()


def deinterleave_rope(weight: torch.Tensor, width: int, rope: int) -> torch.Tensor:
    """The rows of a projection whose outputs are blocks of `width`, each ending in `rope`
    interleaved rope dimensions (x0, x1, x2, ...), with those reordered to (x0, x2, ..., x1, x3,
    ...): the halves `rotate` turns. A bias ([out]) is reordered alike."""
    blocks = weight.view(-1, width, *weight.shape[1:])
    order = torch.cat([torch.arange(width - rope), width - rope + torch.arange(rope).view(-1, 2).T.reshape(-1)])
    return blocks.index_select(1, order).reshape(weight.shape).contiguous()


def stack_heads(model: nn.Module) -> None:
    """Put every CPU HeadLinears of `model` on the grouped kernel, where it runs here and a row's
    bits come out the same at every row count on the heads' shapes (checked, as the dense
    layers' are; otherwise they stay on their probed Linears)."""
    layers = [m for m in model.modules() if isinstance(m, HeadLinears) and m.heads is not None]
    if not layers:
        return
    weight = layers[0].heads[0].weight
    kernel = available().elementwise(weight.dtype, weight.device)
    if kernel is None:
        return
    shapes = {(m.heads[0].in_features, m.out_features) for m in layers}
    for in_features, out_features in shapes:
        packed = pack([probe_weight(out_features, in_features, weight.dtype)], [None])
        if not rule_holds(partial(grouped_gemm, kernel, experts=packed), in_features, weight.dtype, RowRule()):
            return
    for layer in layers:
        layer.stack(kernel)
