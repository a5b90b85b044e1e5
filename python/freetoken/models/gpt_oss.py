"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with per-head sinks and q/k/v/o biases,
sliding-window layers alternating with full ones, YaRN rotary angles, and in every layer a
router with bias choosing the top k experts, weighted by a softmax over the chosen logits.

An expert's gate/up projection comes interleaved (gate in even columns); it is split into
halves at load so the clamped SwiGLU reads contiguous slices. Experts released in MXFP4 stay
MXFP4, about a quarter of bfloat16's bytes: rewritten bit for bit into GGUF's block layout
(kernels/mxfp4.py) and run through the quantized grouped kernel (layers/moe.py's
`use_quantized`); on a device or CPU without that kernel they are dequantized at load, with a
log line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from freetoken.kernels.mxfp4 import BLOCK
from freetoken.kernels.quant import QuantizedWeight, from_mxfp4_blocks
from freetoken.layers.attention import Attention
from freetoken.kernels.grouped_gemm import ROUTES
from freetoken.layers.elementwise import clamped_swiglu, lanewise
from freetoken.layers.linear import Linear
from freetoken.layers.moe import Experts, split_stacked_experts, widen_unsupported_experts
from freetoken.models.llama import LlamaForCausalLM, ModelConfig, fuse_hf_weights


@dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4_experts: bool = False  # the checkpoint's experts are MXFP4 blocks (as released)

    @classmethod
    def from_hf(cls, cfg: dict, **extra) -> GptOssConfig:
        quantization = (cfg.get("quantization_config") or {}).get("quant_method")
        return super().from_hf(cfg, num_experts=cfg["num_local_experts"],
                               num_experts_per_tok=cfg["num_experts_per_tok"],
                               swiglu_alpha=cfg.get("swiglu_alpha", 1.702),
                               swiglu_limit=cfg.get("swiglu_limit", 7.0),
                               mxfp4_experts=quantization == "mxfp4", **extra)


class SinkAttention(Attention):
    """Attention whose softmax also counts a learned per-head logit with no value (a sink).

    softmax over [scores, sink] then the sink dropped equals the plain attention output scaled
    by Z / (Z + e^sink) = sigmoid(lse - sink), lse the log of the keys' normaliser Z. On CPU the
    kernel F.scaled_dot_product_attention runs also returns lse, so a call costs what a plain
    one does and keeps its row invariance."""

    def __init__(self, cfg: GptOssConfig, layer: int):
        super().__init__(cfg, layer)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))

    def _sink_logits(self):
        return self.sinks.float()

    def _sdpa(self, q, k, v, mask, folded):
        cfg = self.cfg
        sinks = self.sinks.float()
        if folded:  # rows are a kv head's query heads, the last one repeated
            per_kv_head = cfg.num_heads // cfg.num_kv_heads
            sinks = sinks.view(cfg.num_kv_heads, per_kv_head)
            sinks = torch.cat([sinks, sinks[:, -1:].expand(-1, q.shape[2] - per_kv_head)], dim=1)
            sinks = sinks[None, :, :, None]
        else:
            sinks = sinks[None, :, None, None]
        float_mask = None
        if mask is not None:
            float_mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            float_mask.masked_fill_(~mask, -math.inf)
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, mask is None, attn_mask=float_mask)
        else:
            out, lse = _attention_with_lse(q, k, v, float_mask)
        # One value per (row, head): lanewise, or its bits would depend on the batch.
        return out * lanewise(torch.sigmoid, lse.float().unsqueeze(-1) - sinks).to(out.dtype)


def _attention_with_lse(q, k, v, float_mask):
    """Plain attention and its log-normaliser, for devices without the CPU kernel."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    if float_mask is None:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        float_mask = torch.zeros(causal.shape, device=q.device).masked_fill_(~causal, -math.inf)
    scores = scores + float_mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype) @ v), lse


class GptOssMoe(Experts):
    """The router (`router`, with bias) and the experts (with biases) of one layer; the top k
    logits weighted by a softmax over them (on the CPU: grouped_gemm.c's moe_route_f32)."""

    router_name = "router"

    def __init__(self, cfg: GptOssConfig):
        activation = partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
        super().__init__(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, bias=True,
                         activation=activation)
        self.router = Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.router.wants_ours = True  # the whole layer runs as one C call only on our kernels
        self.top_k = cfg.num_experts_per_tok
        self.route_mode = ROUTES["ROUTE_TOPK_SOFTMAX"]

    def torch_route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routed(self.router(x))
        return super().forward(x, ids, weights)


class GptOssForCausalLM(LlamaForCausalLM):
    config_class = GptOssConfig
    experts_in_out = True

    def __init__(self, cfg: GptOssConfig):
        super().__init__(cfg)
        # A tensor-parallel rank keeps whole MXFP4 blocks of the experts' intermediate size.
        self.experts_block = BLOCK if cfg.mxfp4_experts else 1
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = SinkAttention(cfg, i)
            layer.mlp = GptOssMoe(cfg)

    def convert_hf_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for i, layer in enumerate(self.model.layers):
            prefix = f"model.layers.{i}.mlp.experts."
            if prefix + "gate_up_proj_blocks" in state:
                _keep_mxfp4(layer.mlp, state, prefix)
            # Released stacked ([E, H, 2I], gate in even columns; biases [E, 2I]) to [gate | up]
            # (a GGUF's experts come split already: layers/moe.py's take_stacked_experts).
            for name in (prefix + "gate_up_proj", prefix + "gate_up_proj_bias"):
                if name in state:
                    value = state[name]
                    state[name] = torch.cat([value[..., 0::2], value[..., 1::2]], dim=-1)
        for stacked in ("gate_up_proj", "down_proj"):
            state = split_stacked_experts(state, stacked, transpose=True)
        return fuse_hf_weights(state)

    def post_load(self, tokenizer, dtype: torch.dtype, device: torch.device) -> None:
        super().post_load(tokenizer, dtype, device)
        widen_unsupported_experts(self, dtype, device)


def _keep_mxfp4(experts: Experts, state: dict[str, torch.Tensor], prefix: str) -> None:
    """A layer's released MXFP4 experts (`prefix` + gate_up_proj / down_proj as `_blocks` [E,
    out, in / 32, 16] and `_scales` [E, out, in / 32], biases [E, out]) onto `experts`, kept
    quantized; the gate/up rows, interleaved (gate even), gathered into [gate | up]."""
    rows = state[prefix + "gate_up_proj_blocks"].shape[1]
    halves = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])
    gate_up_bias = state.pop(prefix + "gate_up_proj_bias", None)
    experts.use_quantized(_mxfp4(state, prefix + "gate_up_proj", halves), _mxfp4(state, prefix + "down_proj"),
                          None if gate_up_bias is None else gate_up_bias[:, halves],
                          state.pop(prefix + "down_proj_bias", None))


def _mxfp4(state: dict[str, torch.Tensor], name: str, rows: torch.Tensor | None = None) -> QuantizedWeight:
    """`name`'s blocks and scales (popped from `state`), its output rows `rows` (all if None), as
    a QuantizedWeight [E, out, in] in GGUF's MXFP4 layout."""
    blocks, scales = state.pop(name + "_blocks"), state.pop(name + "_scales")
    if rows is not None:
        blocks, scales = blocks.index_select(1, rows), scales.index_select(1, rows)
    return from_mxfp4_blocks(blocks, scales)
