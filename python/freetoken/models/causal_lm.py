"""What the loader (models/loader.py) asks of a family's module: built from a transformers
config on the meta device, its checkpoint's names and layouts converted to its own, then a
post-load hook for what the weights do not hold."""

from __future__ import annotations

import torch
from torch import nn


class CausalLM(nn.Module):
    config_class: type  # its `from_hf(hf_config)` reads the family's fields
    # The weights (name endings) held in float32 whatever the model's dtype, as transformers
    # holds them (its `_keep_in_fp32_modules`): GLM-4.5's router, whose choice a rounding changes.
    float32_weights: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, hf_config: dict) -> CausalLM:
        """The module of a transformers config, weights not loaded (the loader builds it on the
        meta device and allocates it once sharded and cast)."""
        return cls(cls.config_class.from_hf(hf_config))

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def reads(self, name: str) -> bool:
        """Does the module hold checkpoint tensor `name` (what it never uses, an image-text
        checkpoint's vision tower, is not read)?"""
        return True

    def convert_hf_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' names and layouts to this module's."""
        return state

    def ties_head(self, state: dict[str, torch.Tensor]) -> bool:
        """Does the LM head share the embedding's weight (`state`: the converted checkpoint)?"""
        return False

    def post_load(self, tokenizer, dtype: torch.dtype, device: torch.device) -> None:
        """Called once the weights are in: what the module builds from the tokenizer; `dtype`
        and `device` those the loader cast the weights to (a quantized layer has no float weight
        to read them from)."""
