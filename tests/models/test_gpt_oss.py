"""gpt-oss against transformers on the same tiny checkpoint (sinks, a sliding window shorter than
the prompts, YaRN, clamped SwiGLU), batch / cache invariance, and MXFP4 experts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.models.gpt_oss import GptOssForCausalLM
from freetoken.models.registry import load_model
from tests.model_fixtures import assert_batch_matches_alone_and_reference, assert_cache_hit_and_chunks_give_the_cold_result

TEXTS = ["What is the capital of France? The capital is Paris.", "def add(a, b):\n    return a + b",
         "Write a short poem about the sea, the wind and the stars", "Numbers 0 1 2 3 4 5 6 7 8 9 10 42",
         "The user asks about the weather in Paris. It is sunny.",
         "Monday, then Tuesday, then Wednesday, then Friday!",
         "Tokenizers split text into pieces, then merge the frequent pairs.",
         "A tiny model predicts the next word, one step at a time, then stops."]


@pytest.fixture(scope="module")
def loaded(tiny_gpt_oss_path):
    return load_model(tiny_gpt_oss_path, dtype="float32", device="cpu")


def test_config_has_a_window_shorter_than_the_prompts_and_yarn(loaded):
    cfg = loaded.model.cfg
    assert isinstance(loaded.model, GptOssForCausalLM)
    assert cfg.sliding_layers == {0} and cfg.rope_yarn is not None and cfg.o_proj_bias
    assert min(len(loaded.tokenizer.encode(t)) for t in TEXTS) > cfg.sliding_window


def test_batch_of_8_matches_transformers_and_each_alone(loaded):
    assert_batch_matches_alone_and_reference(loaded, TEXTS)


def test_prefix_hit_and_chunked_prefill_give_the_cold_result(loaded):
    base = loaded.tokenizer.encode(TEXTS[0] + " " + TEXTS[3])
    cached = assert_cache_hit_and_chunks_give_the_cold_result(loaded, base)
    # Cached prefixes much longer than the window of 8.
    assert cached[0] >= len(base) - 1 and cached[1] >= len(base) - 4 > 2 * 8


def _quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round [..., K] weights (K a multiple of 32) to MXFP4: (blocks [..., K/32, 16], scales)."""
    from freetoken.models.kernels.mxfp4 import FP4_VALUES

    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled.unsqueeze(-1) - torch.tensor(FP4_VALUES)).abs().argmin(-1)  # nearest value
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], 16, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), (exponent + 127).to(torch.uint8)


def _expert_weight(experts, projection: str, e: int) -> torch.Tensor:
    """Expert e's [out, in] weight as loaded, from the grouped kernel's strips or, where the
    experts run on packed Linears (which free the plain weight), through a unit input."""
    if experts.stacked is not None:
        gate_up, down_parts = experts.stacked  # the down projection in parts of its input
        parts = [gate_up] if projection == "gate_up" else down_parts
        strips = torch.cat([p.weight[e].transpose(0, 1).reshape(p.in_features, -1) for p in parts])
        return strips[:, : parts[0].out_features].T
    layer = getattr(experts.experts[e], f"{projection}_proj")
    layers = getattr(layer, "parts", [layer])  # parts.RowParts: the bias is its first part's
    with torch.inference_mode():
        return (layer(torch.eye(sum(p.in_features for p in layers))) - layers[0].bias).T


def test_mxfp4_experts_load_as_transformers_dequantises_them(tiny_gpt_oss_path, tmp_path):
    """A released-style folder (experts as *_blocks / *_scales, [E, out, in]): our loaded expert
    weights equal transformers' own dequantisation of the same bytes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = tmp_path / "mxfp4"
    shutil.copytree(tiny_gpt_oss_path, folder)
    state = load_file(folder / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _quantize_mxfp4(state.pop(name).transpose(1, 2))  # stored [E, out, in]
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
    save_file(state, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    ours = load_model(folder, dtype="float32", device="cpu").model
    for name, blocks in state.items():
        if not name.endswith("_blocks"):
            continue
        scales = state[name.replace("_blocks", "_scales")]
        ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        layer = int(name.split(".")[2])
        experts = ours.model.layers[layer].mlp
        for e in range(experts.num_experts):
            if "gate_up" in name:
                gate_up = ref[e].T  # [2I, H], gate rows even
                expected = torch.cat([gate_up[0::2], gate_up[1::2]])
            else:
                expected = ref[e].T
            weights = _expert_weight(experts, "gate_up" if "gate_up" in name else "down", e)
            assert torch.allclose(weights, expected, atol=1e-6), (name, e)
