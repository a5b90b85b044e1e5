"""gpt-oss against transformers on the same tiny checkpoint (sinks, a sliding window shorter than
the prompts, YaRN, clamped SwiGLU), batch / cache invariance, and MXFP4 experts kept MXFP4."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from safetensors.torch import load_file

from freetoken.models.gpt_oss import GptOssForCausalLM
from freetoken.models.registry import load_model
from freetoken.scheduler.factory import build_scheduler
from tests.model_fixtures import (HARMONY_TEXTS, assert_batch_matches_alone_and_reference,
                                  assert_harmony_cache_hit_and_chunks, greedy_run)



@pytest.fixture(scope="module")
def loaded(tiny_gpt_oss_path):
    return load_model(tiny_gpt_oss_path, dtype="float32", device="cpu")


def test_config_has_a_window_shorter_than_the_prompts_and_yarn(loaded):
    cfg = loaded.model.cfg
    assert isinstance(loaded.model, GptOssForCausalLM)
    assert cfg.sliding_layers == {0} and cfg.rope_scaling is not None and cfg.o_proj_bias
    assert min(len(loaded.tokenizer.encode(t)) for t in HARMONY_TEXTS) > cfg.sliding_window


def test_batch_of_8_matches_transformers_and_each_alone(loaded):
    assert_batch_matches_alone_and_reference(loaded, HARMONY_TEXTS)


def test_prefix_hit_and_chunked_prefill_give_the_cold_result(loaded):
    assert_harmony_cache_hit_and_chunks(loaded)


@pytest.fixture(scope="module")
def loaded_mxfp4(tiny_gpt_oss_mxfp4_path):
    return load_model(tiny_gpt_oss_mxfp4_path, dtype="float32", device="cpu")


def test_mxfp4_experts_stay_mxfp4_and_are_the_values_transformers_dequantises(loaded_mxfp4):
    """A released-style folder (experts as *_blocks / *_scales, [E, out, in / 32, 16]): each
    layer's experts are held as GGUF MXFP4 blocks, the checkpoint's bytes and no more, whose
    values (by gguf's own dequantizer) are transformers' dequantisation of the same bytes, bit
    for bit, gate/up rows gathered into [gate | up]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = load_file(loaded_mxfp4.folder / "model.safetensors")
    for i, layer in enumerate(loaded_mxfp4.model.model.layers):
        held, prefix = layer.mlp.quantized, f"model.layers.{i}.mlp.experts."
        assert layer.mlp.experts is None and layer.mlp.stacked is None
        for name, weight in (("gate_up_proj", *held.gate_up), ("down_proj", held.down)):
            blocks, scales = state[prefix + name + "_blocks"], state[prefix + name + "_scales"]
            assert weight.qtype == GGMLQuantizationType.MXFP4
            assert weight.nbytes == blocks.numel() + scales.numel()
            expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
            if name == "gate_up_proj":  # released rows interleaved, gate even
                expected = torch.cat([expected[:, 0::2], expected[:, 1::2]], dim=1)
            values = gguf_quants.dequantize(weight.data.numpy(), weight.qtype).reshape(weight.shape)
            assert torch.equal(torch.from_numpy(values), expected), (i, name)
        bias = state[prefix + "gate_up_proj_bias"]
        assert torch.equal(held.gate_up_bias, torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))
        assert torch.equal(held.down_bias, state[prefix + "down_proj_bias"])
        # 8 experts of 64 x 64 x 3 weights: 17 bytes per 32 (float32: 128 per 32), biases in float32.
        assert held.nbytes == 8 * 64 * 64 * 3 * 17 // 32 + 8 * (128 + 64) * 4 == 58368


def test_mxfp4_batch_of_8_matches_transformers_on_the_dequantized_weights_and_each_alone(loaded_mxfp4):
    assert_batch_matches_alone_and_reference(loaded_mxfp4, HARMONY_TEXTS)


@pytest.mark.parametrize("fixture", ["loaded", "loaded_mxfp4"])
def test_batched_is_alone_bit_for_bit(fixture, request):
    """Tokens and logprobs, not only within 1e-5 (the sinks' sigmoid, one value per row and
    head, is where a batch's size once showed)."""
    loaded = request.getfixturevalue(fixture)
    prompts = {uid: loaded.tokenizer.encode(text) for uid, text in enumerate(HARMONY_TEXTS[:4])}
    together, _ = greedy_run(build_scheduler(loaded, kv_slots=1024, prefix_cache=False), prompts)
    for uid, ids in prompts.items():
        alone, _ = greedy_run(build_scheduler(loaded, kv_slots=256, prefix_cache=False), {uid: ids})
        assert alone[uid] == together[uid], uid
