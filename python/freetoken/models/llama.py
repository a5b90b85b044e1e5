"""Llama / Mistral / SmolLM3 / Granite / Phi-3 / Qwen2 / Qwen3 decoder over the engine's KV pool,
and the base of the families built on it (qwen3_moe.py, gpt_oss.py, glm4_moe.py, which bring
only their own MLP and attention softmax; gemma3.py, its own layer and embedding scale).

Module names mirror transformers', except that q/k/v and gate/up projections are fused into one
matmul each (`fuse_hf_weights` maps a transformers state dict; Phi-3's stores them so). The
families differ only in q/k/v bias (Qwen2) and per-head q/k RMSNorm (Qwen3). Sliding-window
layers (Mistral's: all of them), layers without rotary embedding (SmolLM3's), a scaled rotary
schedule (YaRN, Llama 3.1's, Phi-3's), rotary on part of each head (Phi-4-mini's), Granite's scales (of the embeddings, the residual adds,
the attention scores and the logits) and an o_proj bias are config fields too. The layers are
layers/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from freetoken.config import original_context, rope_parameters, rope_type
from freetoken.core import Batch
from freetoken.kvcache.forward_context import ForwardContext
from freetoken.models.causal_lm import CausalLM
from freetoken.kernels import decoder_layer
from freetoken.kernels.plan import Available, available
from freetoken.layers.attention import Attention
from freetoken.layers.kernel_choice import UNCAPPED
from freetoken.layers.linear import Linear
from freetoken.layers.mlp import MLP
from freetoken.layers.moe import Experts
from freetoken.layers.norm import RMSNorm
from freetoken.distributed.parts import RowParts
from freetoken.layers.quantized import QuantizedLinear
from freetoken.layers.rotary import SCHEDULES, Schedule, cos_sin


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # of a head's dims, those the rotary embedding turns (Phi-4-mini's: 3/4)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    o_proj_bias: bool = False
    rope_scaling: Schedule | None = None  # None: the default schedule
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    sliding_layers: frozenset[int] = frozenset()
    unrotated_layers: frozenset[int] = frozenset()  # without rotary embedding (SmolLM3's NoPE layers)
    # Granite's scales: of the embeddings, of what each attention and MLP adds to the residual
    # stream, of the attention scores (None: 1 / sqrt(head_dim)), and the logits' divisor.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    logits_scaling: float = 1.0

    @classmethod
    def from_hf(cls, cfg: dict, **extra) -> ModelConfig:
        """The fields transformers' config gives; `extra`: a subclass's own fields."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        rope = rope_parameters(cfg)  # its type one of the family's (registry.check_supported)
        schedule = SCHEDULES.get(rope_type(rope))
        heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        max_positions = cfg.get("max_position_embeddings", 4096)
        if schedule:  # transformers' rule: Phi-3's original context beside the rope's wins
            rope = {**rope, "original_max_position_embeddings": original_context(cfg)}
        # Qwen configs keep a sliding_window value with use_sliding_window false.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        smollm3, interval = arch == "SmolLM3ForCausalLM", cfg.get("no_rope_layer_interval", 4)
        # 0: a layer without rotary embedding; unnamed, SmolLM3 has one every interval layers.
        rotary = cfg.get("no_rope_layers") or [int(not smollm3 or (i + 1) % interval) for i in range(layers)]
        # Without layer_types, SmolLM3 slides its unrotated layers, Qwen those from
        # max_window_layers on (transformers' rules).
        sliding = [not r if smollm3 else i >= cfg.get("max_window_layers", 0) for i, r in enumerate(rotary)]
        types = cfg.get("layer_types") or ["sliding_attention" if s else "full_attention" for s in sliding]
        # Qwen2 and Qwen2-MoE bias q/k/v only (Qwen2-MoE's config says so as `qkv_bias`).
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        bias = cfg.get("attention_bias", cfg.get("qkv_bias", qwen2))
        granite = arch == "GraniteForCausalLM"  # whose attention_multiplier defaults to 1
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            o_proj_bias=bias and not qwen2,
            rope_scaling=schedule and schedule.from_hf(rope, max_positions),
            sliding_window=window,
            sliding_layers=frozenset(i for i, t in enumerate(types) if window and t == "sliding_attention"),
            unrotated_layers=frozenset(i for i, r in enumerate(rotary) if not r),
            embedding_multiplier=cfg.get("embedding_multiplier", 1.0),
            residual_multiplier=cfg.get("residual_multiplier", 1.0),
            attention_scale=cfg.get("attention_multiplier", 1.0 if granite else None),
            logits_scaling=cfg.get("logits_scaling", 1.0),
            **extra,
        )


class DecoderLayer(nn.Module):
    # kernels/decoder_layer.py's call for this layer, made by the kernel plan at load
    # (Backbone.plan_kernels; a layer built outside a load: at its first step); None: the layer
    # always runs in Python.
    one_call: Any = NotImplemented

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, delta, cos, sin, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x, to which `delta` (the previous layer's MLP output; None for the
        first layer) is added in place, then this layer's attention output; returns x and this
        layer's MLP output, left for the next norm to add in the same pass as it normalises."""
        call = self.prepared_call()
        if call is not None and (step := decoder_layer.step(ctx, x, cos, sin, call)) is not None:
            return x, call(x, delta, step, ctx.kv_cache[self.self_attn.layer])
        h = self.input_layernorm(x, delta)
        h = self.post_attention_layernorm(x, self._residual(self.self_attn(h, cos, sin, ctx)))
        return x, self._residual(self.mlp(h))

    def _residual(self, delta: torch.Tensor) -> torch.Tensor:
        """What the attention or the MLP adds to the residual stream (Granite's scaled)."""
        multiplier = self.self_attn.cfg.residual_multiplier
        return delta if multiplier == 1 else delta.mul_(multiplier)

    def prepared_call(self) -> decoder_layer.LayerCall | None:
        """This layer's one C call (planned, or made at the first ask), or None."""
        if self.one_call is NotImplemented:
            self.one_call = self.prepare_call(available().layer)
        return self.one_call

    def prepare_call(self, lib) -> decoder_layer.LayerCall | None:
        """The whole layer as one C call on `lib` (decoder_layer.c's, None: in Python), with the
        bits of the calls below: a plain attention (or gpt-oss's, its sinks on the pool kernel) and
        MLP (not a family's own; or an MoE block whose `one_call` gives the call's arguments) whose linear layers all run on our kernels, whole calls (a row-parallel layer's K parts in one:
        RowParts.fused), rotary on whole heads (not Phi-4-mini's part of each)."""
        attn, mlp = self.self_attn, self.mlp
        sparse = isinstance(mlp, Experts)
        if (not isinstance(attn, Attention) or not attn.in_one_call or not (sparse or type(mlp) is MLP)
                or attn.cfg.rotary_dim != attn.cfg.head_dim):
            return None
        modules = (attn.qkv_proj, attn.o_proj) + (() if sparse else (mlp.gate_up_proj, mlp.down_proj))
        runs = tuple(_call_run(module) for module in modules)
        moe = mlp.one_call(_call_run) if sparse else None
        if any(run is None for run in runs) or (sparse and moe is None):
            return None
        cfg = attn.cfg
        norms = (self.input_layernorm, self.post_attention_layernorm)
        norms += (attn.q_norm, attn.k_norm) if cfg.qk_norm else ()
        return decoder_layer.prepare(lib, runs, norms, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                     attn.sliding, attn.rotary, attn.scale, cfg.residual_multiplier, moe,
                                     attn._sink_logits())


def _call_run(module: nn.Module) -> Any:
    """What decoder_layer.c runs for a linear layer: a quantized layer's (or a row-parallel
    layer's K parts') whole call, a Linear's kernel where it takes every row count unpadded; None:
    neither."""
    if type(module) in (QuantizedLinear, RowParts) and module.fused is not None:
        return module.fused
    if (type(module) is Linear and module.run is not None
            and (module.rule.minimum, module.rule.most) == (1, UNCAPPED)):
        return module.run
    return None


class Backbone(nn.Module):
    # Every layer in one C call a step (kernels/decoder_layer.py's Stack), made by the kernel
    # plan at load (a model built outside a load: at its first step); None: the layers are
    # called one by one.
    stack: Any = NotImplemented

    def __init__(self, cfg: ModelConfig, layer_class: type[nn.Module] = DecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def plan_kernels(self, kernels: Available, dtype: torch.dtype, device: torch.device | str) -> dict[str, str]:
        """kernels/plan.py's question: which layers run as one C call each (kernels.layer: the
        library, None under FREETOKEN_LAYER_KERNEL=0), and whether all as one."""
        calls = []
        for layer in self.layers:
            call = layer.prepare_call(kernels.layer) if isinstance(layer, DecoderLayer) else None
            if isinstance(layer, DecoderLayer):
                layer.one_call = call
            calls.append(call)
        plain = all(type(layer) is DecoderLayer for layer in self.layers)
        self.stack = decoder_layer.stack(calls, [layer.self_attn.layer for layer in self.layers]) if plain else None
        made = sum(call is not None for call in calls)
        if self.stack is not None:
            return {"layer": f"decoder_layer.c, {made} layers in one call"}
        return {"layer": f"decoder_layer.c, {made} of {len(calls)} layers one call each" if made else "Python"}

    def run_layers(self, x, cos, sin, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x through every layer (DecoderLayer.forward's contract): x, and the
        last layer's MLP output, not yet added to it."""
        if self.stack is NotImplemented:
            self.plan_kernels(available(), x.dtype, x.device)
        stack = self.stack
        if stack is not None and (step := decoder_layer.step(ctx, x, cos, sin, stack.first)) is not None:
            return x, stack(x, step, ctx.kv_cache)
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, cos, sin, ctx)
        return x, delta


class LlamaForCausalLM(CausalLM):
    config_class = ModelConfig  # a family's subclass reads its own fields
    # Every row attends on its own keys, so a request's draft rows can each run as a decode step
    # (scheduler/speculation.py).
    verifies_drafts = True
    # The checkpoint's stacked experts are [E, in, out] with gate and up interleaved (gpt-oss),
    # not [E, out, in] with gate then up: a tensor-parallel rank reads other slices of them.
    experts_in_out = False
    # Stacked experts whose intermediate size a tensor-parallel rank takes in whole blocks of this.
    experts_block = 1
    supports_pooling = True  # fills ctx.hidden
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg, self.layer_class)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def convert_hf_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return fuse_hf_weights(state)

    def ties_head(self, state: dict[str, torch.Tensor]) -> bool:
        return self.cfg.tie_word_embeddings

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `ids` (Granite's scaled)."""
        x = self.model.embed_tokens(ids)
        if self.cfg.embedding_multiplier != 1:
            x.mul_(self.cfg.embedding_multiplier)
        return x

    def rotations(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """What the layers turn q and k by: cos and sin of the positions' angles (`cos_sin`)."""
        cfg = self.cfg
        return cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, dtype)

    def forward(self, batch: Batch, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(ctx.input_ids)
        cfg = self.cfg
        cos, sin = self.rotations(ctx.positions, x.dtype)
        x, delta = self.model.run_layers(x, cos, sin, ctx)
        x.add_(delta)
        if ctx.hidden_rows is not None:
            ctx.hidden = self.model.norm(x.index_select(0, ctx.hidden_rows))
            if not len(ctx.logit_rows):  # pooling requests alone: nothing samples
                return x.new_empty(0, self.vocab_size, dtype=torch.float32)
        # Only rows with logits (sampling or prompt logprobs) need the norm and the LM head.
        x = self.model.norm(x.index_select(0, ctx.logit_rows))
        # [rows, len(logit_columns)] where the head computes those columns alone, else [rows, V].
        at = getattr(self.lm_head, "logits_at", None)  # None: a head of another kind
        logits = at(x, ctx.logit_columns) if ctx.logit_columns is not None and at is not None else None
        if logits is None:
            logits = self.lm_head(x)
        if cfg.logits_scaling != 1:  # in the model's dtype, as transformers divides them
            logits = logits.to(x.dtype) / cfg.logits_scaling
        return logits.float()


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_hf_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers state dict with q/k/v and gate/up concatenated as our fused layers want,
    in place: each part is dropped as its fused tensor is made, so the two never all coexist."""
    for name in list(state):
        for target, parts in FUSED.items():
            prefix, dot, suffix = name.rpartition(f".{parts[0]}.")
            if dot:
                names = [f"{prefix}.{part}.{suffix}" for part in parts]
                state[f"{prefix}.{target}.{suffix}"] = torch.cat([state.pop(n) for n in names])
    return state
