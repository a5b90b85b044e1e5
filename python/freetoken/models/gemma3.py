"""Gemma 3 (Gemma3ForCausalLM: 270M, 1B; the language model of Gemma3ForConditionalGeneration:
4B, 12B, 27B, served without its vision tower): the llama family's decoder (models/llama.py)
with Gemma's layer, as transformers' Gemma3 computes it.

- Every RMSNorm scales by (1 + weight): the 1 is added to the weights at load, in float32 as
  transformers adds it, so that the llama family's norm (and its kernels) computes them.
- The embeddings are scaled by sqrt(hidden_size) rounded to their dtype, as transformers does.
- A GeGLU MLP (`gelu_pytorch_tanh`), per-head q/k RMSNorm, attention scores scaled by
  query_pre_attn_scalar ** -0.5.
- Four norms a layer: what the attention and the MLP add to the residual stream is normed too
  (`post_attention_layernorm`, `post_feedforward_layernorm`), and the MLP's input by
  `pre_feedforward_layernorm`.
- The sliding-window layers (`layer_types`; released configs say `sliding_window_pattern`: 5
  of every 6) turn q and k on a rotary schedule of their own (`rope_local_base_freq`), the
  others on `rope_theta` and its scaling (the larger models' `linear` one).

The decoder layer's C call (kernels/decoder_layer.py) computes the llama layer, which has
neither the post-norms nor GeGLU: Gemma's layers always run in Python.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from freetoken.config import rope_type, text_config
from freetoken.layers.mlp import GeGLU
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import SCHEDULES, Schedule, cos_sin
from freetoken.models.llama import DecoderLayer, LlamaForCausalLM, ModelConfig, fuse_hf_weights

log = logging.getLogger("freetoken")

# Gemma3TextConfig's rotary bases where a config names none.
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0
# An image-text checkpoint's language model (transformers 5's layout, then 4's) -> our names.
LANGUAGE_MODEL = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
UNUSED = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    local_rope_theta: float = LOCAL_THETA  # the sliding layers' rotary base
    local_rope_scaling: Schedule | None = None

    @classmethod
    def from_hf(cls, hf_config: dict, **extra) -> Gemma3Config:
        if "vision_config" in hf_config:
            log.warning("Gemma3ForConditionalGeneration: serving the language model only; the vision "
                        "tower is not loaded")
        cfg = text_config(hf_config)
        pattern = cfg.get("sliding_window_pattern", 6)
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                           for i in range(cfg["num_hidden_layers"])]
        rope = cfg.get("rope_parameters") or {}
        # transformers 5 nests the two schedules by layer type; a config written before it has
        # the global layers' scaling as `rope_scaling` and the local base beside it.
        local = rope.get("sliding_attention") or {"rope_theta": cfg.get("rope_local_base_freq", LOCAL_THETA)}
        schedule = SCHEDULES.get(rope_type(local))
        arch = hf_config.get("architectures") or ["Gemma3ForCausalLM"]
        base = super().from_hf({**cfg, "architectures": arch, "layer_types": types,
                                "rope_theta": cfg.get("rope_theta", GLOBAL_THETA),
                                "sliding_window": cfg.get("sliding_window", 4096)},
                               local_rope_theta=local.get("rope_theta", LOCAL_THETA),
                               local_rope_scaling=schedule and schedule.from_hf(
                                   local, cfg.get("max_position_embeddings", 4096)),
                               **extra)
        return replace(base, qk_norm=True, tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                       attention_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5)


class Gemma3DecoderLayer(DecoderLayer):
    one_call = None  # always in Python: the C layer is the llama one

    def __init__(self, cfg: Gemma3Config, layer: int):
        super().__init__(cfg, layer)
        self.mlp = GeGLU(cfg.hidden_size, cfg.intermediate_size)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, delta, cos, sin, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """DecoderLayer.forward's contract; `cos` and `sin` are pairs, the global layers' and
        the sliding layers' (Gemma3ForCausalLM.rotations)."""
        local = self.self_attn.sliding
        h = self.input_layernorm(x, delta)
        attended = self.post_attention_layernorm(self.self_attn(h, cos[local], sin[local], ctx))
        h = self.pre_feedforward_layernorm(x, attended)
        return x, self.post_feedforward_layernorm(self.mlp(h))


class Gemma3ForCausalLM(LlamaForCausalLM):
    config_class = Gemma3Config
    layer_class = Gemma3DecoderLayer

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        # transformers' scale: a float32 scalar cast to the embedding's dtype.
        return x.mul_(torch.tensor(math.sqrt(self.cfg.hidden_size)).to(x.dtype))

    def rotations(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """The global layers' (cos, sin) and the sliding layers', as pairs (cos, cos_local), (sin, sin_local)."""
        cfg = self.cfg
        both = (cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, dtype),
                cos_sin(positions, cfg.rotary_dim, cfg.local_rope_theta, cfg.local_rope_scaling, dtype))
        return tuple(zip(*both))

    def reads(self, name: str) -> bool:
        return not name.startswith(UNUSED)

    def convert_hf_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, value in state.items():
            for prefix, ours in LANGUAGE_MODEL:
                if name.startswith(prefix):
                    name = ours + name.removeprefix(prefix)
            if name.endswith("norm.weight"):
                value = 1.0 + value.float()  # transformers scales by (1 + weight)
            out[name] = value
        return fuse_hf_weights(out)
