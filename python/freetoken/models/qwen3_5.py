"""Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next: hybrids of Gated DeltaNet and full attention.

Most layers are linear attention (layers/delta_rule.py) whose past lives in the engine's
state pool; every few layers one is gated full attention over the KV pool
(layers/attention.py). Module names mirror transformers' after `convert_hf_weights`, which fuses
the projections (q/k/v, gate/up, the DeltaNet's q/k/v/z/b/a), folds the zero-centred RMSNorms'
`1 + weight` into their weights, and takes the language model out of the image-text layout.

The checkpoints' multi-token-prediction head (`mtp.*`) is loaded where it is present, as
`MultiTokenPredictor`: the drafts of `--speculative-config '{"method": "mtp"}'` (engine/mtp.py).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from freetoken.config import rope_parameters
from freetoken.core import Batch
from freetoken.kvcache.forward_context import ForwardContext
from freetoken.kvcache.state_pool import StateShape
from freetoken.models.causal_lm import CausalLM
from freetoken.layers.attention import Attention
from freetoken.layers.delta_rule import GatedDeltaNet
from freetoken.layers.linear import Linear
from freetoken.layers.mlp import MLP
from freetoken.layers.moe import SparseMoeBlock, split_stacked_experts
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import cos_sin, rotate
from freetoken.models.llama import Backbone, fuse_hf_weights

log = logging.getLogger("freetoken")

# The RMSNorms transformers scales by (1 + weight): folded into the weight at load.
_ZERO_CENTRED = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|model\.norm|mtp\.norm"
                           r"|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$")


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
    mtp_layers: int = 0  # the MTP head's decoder layers (Qwen3.5's mtp_num_hidden_layers)

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
        if "vision_config" in cfg:
            log.warning("%s: serving the language model only; the vision tower is not loaded",
                        (cfg.get("architectures") or ["?"])[0])
        cfg = cfg.get("text_config") or cfg
        rope = rope_parameters(cfg)  # the default schedule (registry.check_supported)
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
            # vLLM's default where the config does not say: a checkpoint without mtp.* has none.
            mtp_layers=cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 1)),
        )


class GatedAttention(Attention):
    """Full attention with a sigmoid output gate (q_proj gives each head's query and gate),
    per-head q/k RMSNorm and rotary embedding on the first `rotary_dim` dims only."""

    in_one_call = False

    def __init__(self, cfg: HybridConfig, kv_layer: int):
        nn.Module.__init__(self)
        self.cfg, self.layer = cfg, kv_layer
        h, d, heads, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.qkv_proj = Linear(h, (2 * heads + 2 * kvh) * d, bias=cfg.attention_bias)
        self.o_proj = Linear(heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        q, k, v, gate = self._project(x, cos, sin)
        out = self._attend(q, k, v, ctx)
        return self.o_proj(out.reshape(x.shape[0], -1) * torch.sigmoid(gate))

    def _project(self, x, cos, sin) -> tuple[torch.Tensor, ...]:
        """Rotated queries and keys, values, and the output gate's logits."""
        self.planned(x)
        cfg, t = self.cfg, x.shape[0]
        heads, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.qkv_proj(x)
        query_gate = qkv[:, : 2 * heads * d].view(t, heads, 2 * d)
        kv = qkv[:, 2 * heads * d :].view(t, 2 * kvh, d)
        qk = torch.cat([self.q_norm(query_gate[..., :d]), self.k_norm(kv[:, :kvh])], dim=1)
        qk = rotate(qk, cos, sin, self.rotary_lib)
        return qk[:, :heads], qk[:, heads:], kv[:, kvh:], query_gate[..., d:].reshape(t, -1)


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
                    if index in cfg.moe_layers else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            x = x + self.linear_attn(h, ctx)
        else:
            x = x + self.self_attn(h, cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class MultiTokenPredictor(nn.Module):
    """The MTP head (vLLM's Qwen3_5MultiTokenPredictor): the main model's final-norm hidden
    state at position i and the embedding of token i + 1, each RMS-normed, concatenated and
    projected (`fc`), then a full-attention decoder layer over its own K/V (the pool's layers
    after the main model's), then a final norm; the main model's LM head reads it as the
    logits of token i + 2. Its output stands in for the main model's hidden state at i + 1 in
    the next draft step."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        h, first = cfg.hidden_size, cfg.num_layers
        # Laid out as layers after the main model's: their K/V layer indices follow its own.
        extended = replace(cfg, layer_types=cfg.layer_types + ("full_attention",) * cfg.mtp_layers,
                           moe_layers=cfg.moe_layers + tuple(range(first, first + cfg.mtp_layers))
                           if cfg.num_experts else ())
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(HybridLayer(extended, first + i) for i in range(cfg.mtp_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.cfg = cfg

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final-normed outputs of rows pairing `hidden` (the state before each row's token) with
        `embedded` (the token's embedding); their K/V written at ctx.out_slots."""
        x, cos, sin = self._input(hidden, embedded, ctx)
        return self.norm(self.layers[0](x, cos, sin, ctx))

    def store(self, hidden: torch.Tensor, embedded: torch.Tensor, ctx: ForwardContext) -> None:
        """Only the rows' K/V, as `forward` writes them: one layer's K/V depend on its rows alone."""
        x, cos, sin = self._input(hidden, embedded, ctx)
        layer = self.layers[0]
        _, k, v, _ = layer.self_attn._project(layer.input_layernorm(x), cos, sin)
        layer.self_attn.store(k, v, ctx)

    def _input(self, hidden, embedded, ctx: ForwardContext) -> tuple[torch.Tensor, ...]:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return x, *cos_sin(ctx.positions, self.cfg.rotary_dim, self.cfg.rope_theta, None, x.dtype)


class Qwen3_5ForCausalLM(CausalLM):
    """Every hybrid architecture of models/registry.py."""

    config_class = HybridConfig
    # A draft's rows run through the recurrent layers one round per row, each from the state the
    # row before left (layers/delta_rule.py), and the accepted rows' state is kept.
    verifies_drafts = True

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg, HybridLayer)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # None where the checkpoint has no MTP weights (convert_hf_weights finds out).
        self.mtp = MultiTokenPredictor(cfg) if cfg.mtp_layers else None

    @property
    def state_shape(self) -> StateShape:
        cfg = self.cfg
        return StateShape(layers=cfg.layer_types.count("linear_attention"),
                          conv=(cfg.conv_kernel - 1, cfg.conv_dim),
                          recurrent=(cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim))

    def forward(self, batch: Batch, ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embed_tokens(ctx.input_ids)
        cos, sin = cos_sin(ctx.positions, self.cfg.rotary_dim, self.cfg.rope_theta, None, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        if ctx.mtp is not None:  # the MTP head's K/V of this step's rows (engine/mtp.py)
            ctx.mtp.hidden = self.model.norm(x)
            previous = torch.cat([ctx.mtp.hidden, ctx.mtp.carried]).index_select(0, ctx.mtp.previous_rows)
            self.mtp.store(previous, self.model.embed_tokens(ctx.mtp.ctx.input_ids), ctx.mtp.ctx)
        x = self.model.norm(x.index_select(0, ctx.logit_rows))
        return self.lm_head(x).float()

    def ties_head(self, state: dict[str, torch.Tensor]) -> bool:
        # The text config of an image-text release need not say: a checkpoint without a head ties.
        return "lm_head.weight" not in state

    def convert_hf_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' names and layouts (text-only, image-text or Qwen3-Next) to ours."""
        cfg = self.cfg
        out = {}
        if not any(name.startswith("mtp.") for name in state):
            self.mtp = None
        for name, value in state.items():
            if name.startswith("model.visual.") or (name.startswith("mtp.") and self.mtp is None):
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
