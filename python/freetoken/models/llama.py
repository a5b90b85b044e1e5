"""Llama / Qwen2 / Qwen3 decoder over the engine's KV pool.

Module names mirror transformers', except that q/k/v and gate/up projections are fused into one
matmul each (`fuse_hf_weights` maps a transformers state dict). The three families differ only
in q/k/v bias (Qwen2) and per-head q/k RMSNorm (Qwen3). Sliding-window layers, YaRN and an
o_proj bias are config fields too, so that the families built on this decoder (qwen3_moe.py,
gpt_oss.py) bring only their own MLP and attention softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.core import Batch
from freetoken.models.linear import Linear
from freetoken.models.rope import Yarn, rope_frequencies


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    o_proj_bias: bool = False
    rope_yarn: Yarn | None = None
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    sliding_layers: frozenset[int] = frozenset()

    @classmethod
    def from_hf(cls, cfg: dict, **extra) -> ModelConfig:
        """The fields transformers' config gives; `extra`: a subclass's own fields."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn", None):
            raise ValueError(f"rope_type {rope_type!r} is not supported")
        heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        max_positions = cfg.get("max_position_embeddings", 4096)
        # Qwen configs keep a sliding_window value with use_sliding_window false.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        # Without layer_types, layers from max_window_layers on slide (transformers' Qwen rule).
        types = cfg.get("layer_types") or ["full_attention" if i < cfg.get("max_window_layers", 0)
                                           else "sliding_attention" for i in range(layers)]
        # Qwen2 and Qwen2-MoE bias q/k/v only (Qwen2-MoE's config says so as `qkv_bias`).
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        bias = cfg.get("attention_bias", cfg.get("qkv_bias", qwen2))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            o_proj_bias=bias and not qwen2,
            rope_yarn=Yarn.from_hf(rope, max_positions) if rope_type == "yarn" else None,
            sliding_window=window,
            sliding_layers=frozenset(i for i, t in enumerate(types) if window and t == "sliding_attention"),
            **extra,
        )


# CPU attention kernels round a row differently when a call has fewer than 4 queries per head:
# a decoding request's queries per kv head are padded to 4 by repeating the last one.
MIN_QUERY_ROWS = 4


@dataclass
class PromptGroup:
    """Prompt chunks whose queries and keys are padded to the same lengths, attended in one call.

    Each member's queries are padded (repeating its last query) and its keys padded (masked,
    pointing at the pool's zeroed scratch slot) to lengths fixed by its own lengths alone
    (engine.PROMPT_QUERY_BLOCK, engine.PROMPT_KV_BLOCK): the batched call then gives each member
    the bits it gets alone, which a call padded to the batch's longest member does not.
    """

    shape: tuple[int, int, int]  # (B members, Q queries, L keys) each
    query_rows: torch.Tensor  # [B * Q] indices into the step's tokens, member after member
    kv_slots: torch.Tensor  # [B * L]
    mask: torch.Tensor | None  # [B, 1, Q, L] bool: the key is visible to the query; None: causal
    kept: torch.Tensor  # [N] positions in the flattened [B * Q] output of the real queries
    out_rows: torch.Tensor  # [N] their indices into the step's tokens
    window_mask: torch.Tensor | None = None  # [B, 1, Q, L] bool, for sliding-window layers


@dataclass
class DecodeGroup:
    """Decoding requests (one new token each) whose keys are padded to the same length.

    As PromptGroup, with each kv head's queries folded into rows, padded to MIN_QUERY_ROWS.
    """

    rows: torch.Tensor  # [B] indices into the step's tokens
    kv_slots: torch.Tensor  # [B * L]: member after member, each padded to L
    valid: torch.Tensor  # [B, 1, 1, L] bool, False on padding
    window_valid: torch.Tensor | None = None  # as valid, for sliding-window layers


@dataclass
class ForwardContext:
    """Tensors the engine builds once per step for every layer.

    Greedy results must not depend on what else is in the batch (nor on whether a prefix came
    from the cache), so requests attend in groups built for that (PromptGroup, DecodeGroup).
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] pool slot that receives each token's K/V
    prompt_groups: list[PromptGroup]
    decode_groups: list[DecodeGroup]
    logit_rows: torch.Tensor  # [R] rows of T whose hidden state produces logits
    kv_cache: list[torch.Tensor]  # per layer [num_slots + 1, 2 * kv_heads, head_dim], K then V
    linear: Any = None  # hybrid models: engine.state_pool.LinearContext
    # Embeddings (engine/pooling.py): rows of T whose final-norm hidden states the forward also
    # leaves in `hidden`, for models with `supports_pooling`.
    hidden_rows: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and scale after the cast, as transformers does.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    sliding = False  # a sliding-window layer (subclasses with their own __init__ have none)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, d, heads, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.qkv_proj = Linear(h, (heads + 2 * kvh) * d, bias=cfg.attention_bias)
        self.o_proj = Linear(heads * d, h, bias=cfg.o_proj_bias)
        self.sliding = layer in cfg.sliding_layers
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        heads, kvh = cfg.num_heads, cfg.num_kv_heads
        qkv = self.qkv_proj(x).view(t, heads + 2 * kvh, cfg.head_dim)
        qk = qkv[:, : heads + kvh]
        if cfg.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        qk = rotate(qk, cos, sin)
        out = self._attend(qk[:, :heads], qk[:, heads:], qkv[:, heads + kvh :], ctx)
        return self.o_proj(out.reshape(t, -1))

    def _attend(self, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        """Store the step's keys and values [T, kv heads, d] in the pool, then attend the
        queries [T, heads, d] in the step's groups."""
        kv_cache = ctx.kv_cache[self.layer]
        kv_cache.index_copy_(0, ctx.out_slots, torch.cat([k, v], dim=1).to(kv_cache.dtype))
        out = torch.zeros_like(q)
        for group in ctx.prompt_groups:
            out.index_copy_(0, group.out_rows, self._prompt(q, kv_cache, group))
        for group in ctx.decode_groups:
            out.index_copy_(0, group.rows, self._decode(q.index_select(0, group.rows), kv_cache, group))
        return out

    def _prompt(self, q, kv_cache, group: PromptGroup) -> torch.Tensor:
        cfg, kvh = self.cfg, self.cfg.num_kv_heads
        b, _, length = group.shape
        # index_select, not kv_cache[slots]: advanced indexing copies several times slower.
        q = q.index_select(0, group.query_rows).view(b, -1, cfg.num_heads, cfg.head_dim)
        kv = kv_cache.index_select(0, group.kv_slots).view(b, length, 2 * kvh, cfg.head_dim)
        kv = kv.permute(0, 2, 1, 3)
        mask = group.window_mask if self.sliding else group.mask
        attn = self._sdpa(q.transpose(1, 2), kv[:, :kvh], kv[:, kvh:], mask, folded=False)
        return attn.transpose(1, 2).reshape(-1, cfg.num_heads, cfg.head_dim).index_select(0, group.kept)

    def _decode(self, q, kv_cache, group: DecodeGroup) -> torch.Tensor:
        cfg, b, kvh = self.cfg, q.shape[0], self.cfg.num_kv_heads
        per_kv_head = cfg.num_heads // cfg.num_kv_heads
        q = q.view(b, cfg.num_kv_heads, per_kv_head, cfg.head_dim)
        if per_kv_head < MIN_QUERY_ROWS:
            q = torch.cat([q, q[:, :, -1:].expand(-1, -1, MIN_QUERY_ROWS - per_kv_head, -1)], dim=2)
        kv = kv_cache.index_select(0, group.kv_slots).view(b, -1, 2 * kvh, cfg.head_dim).permute(0, 2, 1, 3)
        valid = group.window_valid if self.sliding else group.valid
        attn = self._sdpa(q, kv[:, :kvh], kv[:, kvh:], valid, folded=True)
        return attn[:, :, :per_kv_head].reshape(b, cfg.num_heads, cfg.head_dim)

    def _sdpa(self, q, k, v, mask: torch.Tensor | None, folded: bool) -> torch.Tensor:
        """SDPA over q [B, heads, Q, d] and k, v [B, kv heads, L, d], causal when `mask` is
        None. `folded`: a decode call, whose q is [B, kv heads, rows, d] with each kv head's
        query heads as rows (padded by repeating the last)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=not folded)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        half = gate_up.shape[-1] // 2
        # silu makes the gate half contiguous; multiplying in place saves a tensor the size of it.
        return self.down_proj(F.silu(gate_up[:, :half]).mul_(gate_up[:, half:]))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        h = self.post_attention_layernorm(x)
        return x + self.mlp(h)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_class: type[nn.Module] = DecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    config_class = ModelConfig  # a family's subclass reads its own fields
    # Every row attends on its own keys, so a request's draft rows can each run as a decode step
    # (scheduler/speculation.py); a hybrid's recurrent layers hold one state per request.
    verifies_drafts = True
    supports_pooling = True  # fills ctx.hidden

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @staticmethod
    def convert_hf_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' names and layouts to this module's."""
        return fuse_hf_weights(state)

    def forward(self, batch: Batch, ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embed_tokens(ctx.input_ids)
        # Rotary angles in fp32 whatever the weights' dtype, as transformers computes them.
        cfg = self.cfg
        inv_freq, scale = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_yarn, ctx.positions.device)
        freqs = ctx.positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, dim], broadcast over heads
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        if ctx.hidden_rows is not None:
            ctx.hidden = self.model.norm(x.index_select(0, ctx.hidden_rows))
        # Only rows with logits (sampling or prompt logprobs) need the norm and the LM head.
        x = self.model.norm(x.index_select(0, ctx.logit_rows))
        return self.lm_head(x).float()


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_hf_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers state dict with q/k/v and gate/up concatenated as our fused layers want."""
    fused = dict(state)
    for name in state:
        for target, parts in FUSED.items():
            prefix, dot, suffix = name.rpartition(f".{parts[0]}.")
            if dot:
                names = [f"{prefix}.{part}.{suffix}" for part in parts]
                fused[f"{prefix}.{target}.{suffix}"] = torch.cat([fused.pop(n) for n in names])
    return fused
