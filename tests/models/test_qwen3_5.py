"""The hybrids (Gated DeltaNet + gated attention) against transformers on the same weights."""

from __future__ import annotations

import pytest

from tests.model_fixtures import assert_greedy_matches_hf, loaded_fp32

# The first is longer than the delta rule's chunk (64): its prefill crosses a chunk boundary and
# ends inside the next chunk. The second prefills in one partial chunk beside it.
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 9, "def fibonacci(n):"]


@pytest.mark.parametrize("variant", ["qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_next"])
def test_hybrid_matches_transformers(variant, tiny_hybrid_path):
    loaded = loaded_fp32(tiny_hybrid_path(variant))
    cfg = loaded.model.cfg
    assert cfg.layer_types.count("linear_attention") == 3 and cfg.rotary_dim == 4
    assert bool(cfg.moe_layers) == (variant in ("qwen3_5_moe_text", "qwen3_next"))
    assert len(loaded.tokenizer.encode(PROMPTS[0])) > 64
    # The other layouts differ in loading and in the MLP only: one prompt is enough for them.
    assert_greedy_matches_hf(loaded, PROMPTS if variant == "qwen3_5_text" else PROMPTS[:1])
