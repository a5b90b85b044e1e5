"""Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next: hybrids of Gated DeltaNet and full attention.

Most layers are linear attention (models/gated_deltanet.py) whose past lives in the engine's
state pool; every few layers one is gated full attention over the KV pool (the attention groups
of models/llama.py). Module names mirror transformers' after `convert_hf_weights`, which fuses
the projections (q/k/v, gate/up, the DeltaNet's q/k/v/z/b/a), folds the zero-centred RMSNorms'
`1 + weight` into their weights, and takes the language model out of the image-text layout.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.core import Batch
from freetoken.engine.state_pool import StateShape
from freetoken.models import gated_deltanet as gdn
from freetoken.models.linear import Linear
from freetoken.models.llama import (MLP, Attention, Backbone, ForwardContext, RMSNorm, fuse_hf_weights,
                                    rotate)
from freetoken.models.qwen3_moe import SparseMoeBlock

log = logging.getLogger("freetoken")

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                 "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM")


@dataclass(frozen=True)
class HybridConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_kernel: int
    # MoE (num_experts 0: dense MLPs everywhere)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_kv_layers(self) -> int:
        return self.layer_types.count("full_attention")

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    @classmethod
    def from_hf(cls, cfg: dict) -> HybridConfig:
        cfg = cfg.get("text_config") or cfg
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported")
        layers = cfg["num_hidden_layers"]
        interval = cfg.get("full_attention_interval", 4)
        types = cfg.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                           for i in range(layers)]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        experts = cfg.get("num_experts", 0)
        # Qwen3.5-MoE: every layer; Qwen3-Next: every decoder_sparse_step-th, but mlp_only_layers.
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0, layer_types=tuple(types),
            num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
            head_dim=head_dim,
            rotary_dim=int(head_dim * rope.get("partial_rotary_factor",
                                               cfg.get("partial_rotary_factor", 0.25))),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            attention_bias=cfg.get("attention_bias", False),
            linear_k_heads=cfg["linear_num_key_heads"], linear_v_heads=cfg["linear_num_value_heads"],
            linear_k_dim=cfg["linear_key_head_dim"], linear_v_dim=cfg["linear_value_head_dim"],
            conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
            num_experts=experts, experts_per_token=cfg.get("num_experts_per_tok", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            moe_layers=tuple(i for i in range(layers)
                             if experts > 0 and (i + 1) % step == 0 and i not in dense),
        )


class GatedAttention(Attention):
    """Full attention with a sigmoid output gate (q_proj gives each head's query and gate),
    per-head q/k RMSNorm and rotary embedding on the first `rotary_dim` dims only."""

    def __init__(self, cfg: HybridConfig, kv_layer: int):
        nn.Module.__init__(self)
        self.cfg, self.layer = cfg, kv_layer
        h, d, heads, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.qkv_proj = Linear(h, (2 * heads + 2 * kvh) * d, bias=cfg.attention_bias)
        self.o_proj = Linear(heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        heads, kvh, d, r = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim
        qkv = self.qkv_proj(x)
        query_gate = qkv[:, : 2 * heads * d].view(t, heads, 2 * d)
        kv = qkv[:, 2 * heads * d :].view(t, 2 * kvh, d)
        qk = torch.cat([self.q_norm(query_gate[..., :d]), self.k_norm(kv[:, :kvh])], dim=1)
        qk = torch.cat([rotate(qk[..., :r], cos, sin), qk[..., r:]], dim=-1)
        out = self._attend(qk[:, :heads], qk[:, heads:], kv[:, kvh:], ctx)
        gate = torch.sigmoid(query_gate[..., d:].reshape(t, -1))
        return self.o_proj(out.reshape(t, -1) * gate)


class GatedDeltaNet(nn.Module):
    """Linear attention: in_proj = [q k v | z | b | a] (q/k/v through the causal conv), the gated
    delta rule over the request's state, an RMSNorm gated by silu(z), out_proj."""

    def __init__(self, cfg: HybridConfig, state_layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, state_layer
        v_dim = cfg.linear_v_heads * cfg.linear_v_dim
        self.in_proj = Linear(cfg.hidden_size, cfg.conv_dim + v_dim + 2 * cfg.linear_v_heads, bias=False)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(cfg.linear_v_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.linear_v_heads))
        self.norm = RMSNorm(cfg.linear_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(v_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cfg, lin, t = self.cfg, ctx.linear, x.shape[0]
        kh, dk, vh, dv = cfg.linear_k_heads, cfg.linear_k_dim, cfg.linear_v_heads, cfg.linear_v_dim
        groups, c, past = vh // kh, cfg.conv_dim, cfg.conv_kernel - 1
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split([c, vh * dv, vh, vh], dim=-1)
        beta, g = gdn.gates(b, a, -self.A_log.float().exp(), self.dt_bias)
        weight = self.conv1d.weight[:, 0]
        conv_pool, rec_pool = lin.pool.conv[self.layer], lin.pool.recurrent[self.layer]

        def split(conv_out):
            q, k, v = conv_out.split([kh * dk, kh * dk, vh * dv], dim=-1)
            lead = conv_out.shape[:-1]
            return q.view(*lead, kh, dk), k.view(*lead, kh, dk), v.view(*lead, vh, dv)

        out = torch.zeros(t, vh, dv, dtype=torch.float32, device=x.device)
        slots, convs, states = [], [], []
        for piece in lin.prefills:
            rows = slice(piece.row, piece.row + piece.n)
            resumed = piece.start > 0
            prev = conv_pool[piece.slot].to(mixed.dtype) if resumed else mixed.new_zeros(past, c)
            window = torch.cat([prev, mixed[rows]])
            q, k, v = split(gdn.causal_conv(window, weight))
            o, boundaries, state = gdn.chunked(q, k, v, g[rows], beta[rows],
                                               rec_pool[piece.slot] if resumed else None, piece.start, groups)
            out[rows] = o
            slots.append(piece.slot)
            convs.append(window[-past:])
            states.append(state)
            for pos, snap in piece.snapshots.items():
                slots.append(snap)
                convs.append(window[pos - piece.start : pos - piece.start + past])
                states.append(boundaries[pos])
        if slots:
            lin.staged.append((self.layer, torch.tensor(slots, device=x.device), torch.stack(convs),
                               torch.stack(states)))
        if lin.decode_rows is not None:
            rows, held = lin.decode_rows, lin.decode_slots
            window = torch.cat([conv_pool.index_select(0, held).to(mixed.dtype),
                                mixed.index_select(0, rows)[:, None]], dim=1)
            q, k, v = split(gdn.causal_conv(window, weight)[:, 0])
            o, state = gdn.recurrent(q, k, v, g.index_select(0, rows), beta.index_select(0, rows),
                                     rec_pool.index_select(0, held), groups)
            out.index_copy_(0, rows, o)
            lin.staged.append((self.layer, held, window[:, 1:], state))
        out = (self.norm(out) * F.silu(z.float().view(t, vh, dv))).to(x.dtype)
        return self.out_proj(out.view(t, -1))


class HybridLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, index: int):
        super().__init__()
        kind = cfg.layer_types[index]
        before = cfg.layer_types[:index]
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, before.count("linear_attention"))
        else:
            self.self_attn = GatedAttention(cfg, before.count("full_attention"))
        self.mlp = (SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                                   cfg.experts_per_token, cfg.norm_topk_prob,
                                   cfg.shared_expert_intermediate_size)
                    if index in cfg.moe_layers else MLP(cfg))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            x = x + self.linear_attn(h, ctx)
        else:
            x = x + self.self_attn(h, cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg, HybridLayer)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def state_shape(self) -> StateShape:
        cfg = self.cfg
        return StateShape(layers=cfg.layer_types.count("linear_attention"),
                          conv=(cfg.conv_kernel - 1, cfg.conv_dim),
                          recurrent=(cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim))

    def forward(self, batch: Batch, ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embed_tokens(ctx.input_ids)
        dim = self.cfg.rotary_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=ctx.positions.device) / dim
        freqs = ctx.positions.float()[:, None] * (1.0 / (self.cfg.rope_theta**exponent))[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        x = self.model.norm(x.index_select(0, ctx.logit_rows))
        return self.lm_head(x).float()


_ZERO_CENTRED = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|model\.norm)\.weight$")


def convert_hf_weights(state: dict[str, torch.Tensor], cfg: HybridConfig) -> dict[str, torch.Tensor]:
    """transformers' names and layouts (text-only, image-text or Qwen3-Next) to ours."""
    from freetoken.models.moe import split_stacked_experts

    out = {}
    for name, value in state.items():
        if name.startswith(("mtp.", "model.visual.")):
            continue
        name = name.replace("model.language_model.", "model.")
        if _ZERO_CENTRED.search(name):
            value = 1.0 + value.float()  # transformers scales by (1 + weight)
        out[name] = value
    for prefix in {n.rpartition("linear_attn.")[0] for n in out if "linear_attn." in n}:
        p = prefix + "linear_attn."
        if p + "in_proj_qkvz.weight" in out:  # Qwen3-Next: grouped per key head
            qkvz, ba = out.pop(p + "in_proj_qkvz.weight"), out.pop(p + "in_proj_ba.weight")
            kh, dk, dv = cfg.linear_k_heads, cfg.linear_k_dim, cfg.linear_v_dim
            r = cfg.linear_v_heads // kh
            q, k, v, z = qkvz.view(kh, -1, qkvz.shape[-1]).split([dk, dk, r * dv, r * dv], dim=1)
            b, a = ba.view(kh, 2 * r, -1).split([r, r], dim=1)
            parts = [x.reshape(-1, qkvz.shape[-1]) for x in (q, k, v, z, b, a)]
        else:
            parts = [out.pop(p + f"in_proj_{s}.weight") for s in ("qkv", "z", "b", "a")]
        out[p + "in_proj.weight"] = torch.cat(parts)
    for stacked in ("gate_up_proj", "down_proj"):
        out = split_stacked_experts(out, stacked)
    return fuse_hf_weights(out)


def build_hybrid(folder: Path, hf_config: dict, dtype: torch.dtype, device: torch.device):
    from safetensors.torch import load_file

    from freetoken.models.linear import pack_linears
    from freetoken.models.moe import stack_experts

    cfg = HybridConfig.from_hf(hf_config)
    if "vision_config" in hf_config:
        log.warning("%s: serving the language model only; the vision tower is not loaded", folder.name)
    with torch.device("meta"):
        module = Qwen3_5ForCausalLM(cfg)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    state = convert_hf_weights(state, cfg)
    module.to_empty(device=device)
    missing, unexpected = module.load_state_dict(state, strict=False)
    tied = "lm_head.weight" in missing
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        from freetoken.models.loader import ModelNotFound

        raise ModelNotFound(f"Weights do not match the architecture: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
    if tied:
        module.lm_head.weight = module.model.embed_tokens.weight
    module.to(dtype).requires_grad_(False)
    stack_experts(module)
    pack_linears(module)
    return module
