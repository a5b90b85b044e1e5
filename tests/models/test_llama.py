"""Our forward against transformers on the same weights (an independent implementation): the
default model, tiny Qwen3 and Qwen2, and tiny Mistral (a sliding window on every layer, shorter
than the prompts), SmolLM3 (a layer without rotary embedding), Llama 3.1-style Llama (the
`llama3` rotary schedule), Granite (its four scales) and Phi-4-mini-style Phi-3 (fused
projections, a window, partial rotary, longrope), those also batched, after a prefix-cache hit,
in prefill chunks, Mistral, Llama 3, Phi-3, Phi-4-mini, SmolLM3 and Granite (Q8_0, Q4_K_M) as
the GGUFs llama.cpp makes of them, SmolLM3 and Phi-4-mini on the kernel of the decoder layer's C
call."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.config import WeightsConfig
from freetoken.models.llama import LlamaForCausalLM, ModelConfig
from freetoken.models.registry import load_model
from freetoken.scheduler.factory import build_scheduler
from tests.model_fixtures import (HARMONY_TEXTS, assert_batch_matches_alone_and_reference,
                                  assert_family_gguf_matches_reference, assert_harmony_cache_hit_and_chunks,
                                  assert_greedy_matches_hf,
                                  assert_matches_reference, assert_same_run, default_model, greedy_run,
                                  tiny_random_folder)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           # 54 tokens: decoding crosses 64 keys, where a request's padded key block grows
           # (engine.DECODE_KV_BLOCK).
           "Count with me: " + ", ".join(str(n) for n in range(1, 17))]


@pytest.mark.slow
def test_default_model_matches_transformers():
    assert_greedy_matches_hf(default_model(), PROMPTS)


def test_tiny_random_qwen3_matches_transformers():
    loaded = load_model(tiny_random_folder("qwen3"), dtype="float32", device="cpu")
    assert loaded.model.cfg.qk_norm and not loaded.model.cfg.tie_word_embeddings
    assert_greedy_matches_hf(loaded, PROMPTS)


def test_tiny_random_qwen2_matches_transformers():
    loaded = load_model(tiny_random_folder("qwen2"), dtype="float32", device="cpu")
    assert loaded.model.cfg.attention_bias and not loaded.model.cfg.qk_norm
    assert_greedy_matches_hf(loaded, PROMPTS)


@pytest.fixture(scope="module", params=["tiny_mistral_path", "tiny_smollm3_path", "tiny_llama3_path",
                                        "tiny_granite_path", "tiny_phi3_path"])
def on_harmony(request):
    """The tiny Mistral, SmolLM3, Llama 3.1-style Llama, Granite and Phi-3
    (tests/fixtures/build_models.py)."""
    return load_model(request.getfixturevalue(request.param), dtype="float32", device="cpu")


def test_mistral_slides_every_layer_in_a_window_shorter_than_the_prompts(tiny_mistral_path):
    loaded = load_model(tiny_mistral_path, dtype="float32", device="cpu")
    cfg = loaded.model.cfg
    assert type(loaded.model) is LlamaForCausalLM and not cfg.unrotated_layers
    assert cfg.sliding_window == 8 and cfg.sliding_layers == {0, 1}
    assert min(len(loaded.tokenizer.encode(t)) for t in HARMONY_TEXTS) > cfg.sliding_window


def test_smollm3s_fourth_layer_has_no_rotary_embedding(tiny_smollm3_path):
    loaded = load_model(tiny_smollm3_path, dtype="float32", device="cpu")
    assert type(loaded.model) is LlamaForCausalLM
    assert loaded.model.cfg.unrotated_layers == {3} and not loaded.model.cfg.sliding_layers
    assert [layer.self_attn.rotary for layer in loaded.model.model.layers] == [True, True, True, False]


def test_smollm3_layers_its_config_does_not_list_follow_transformers_defaults():
    """Without no_rope_layers and layer_types, every no_rope_layer_interval-th layer is unrotated
    and, with a window on, slides: as transformers' SmolLM3Config fills them in."""
    from transformers import SmolLM3Config

    fields = dict(num_hidden_layers=9, no_rope_layer_interval=3, use_sliding_window=True, sliding_window=16,
                  vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    reference = SmolLM3Config(**fields)
    cfg = ModelConfig.from_hf({**fields, "architectures": ["SmolLM3ForCausalLM"]})
    assert cfg.unrotated_layers == {i for i, rotary in enumerate(reference.no_rope_layers) if not rotary} == {2, 5, 8}
    assert cfg.sliding_layers == {i for i, t in enumerate(reference.layer_types) if t == "sliding_attention"}


def test_llama31s_config_as_released_scales_the_rotary_frequencies():
    """Llama 3.1's config.json (transformers 4's layout: `rope_scaling`, `rope_theta` beside it)
    reads as the tiny Llama 3's (transformers 5's `rope_parameters`), whose frequencies the
    schedule changes: kept, blended and divided by the factor."""
    from transformers import LlamaConfig

    from freetoken.layers.rotary import rope_frequencies

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    fields = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_hidden_layers=1,
                  max_position_embeddings=2048)
    released = ModelConfig.from_hf({**fields, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "llama3", **scaling}})
    current = LlamaConfig(**fields, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, **scaling})
    assert released == ModelConfig.from_hf(current.to_dict())
    scaled, _ = rope_frequencies(16, 10000.0, released.rope_scaling, torch.device("cpu"))
    plain, _ = rope_frequencies(16, 10000.0, None, torch.device("cpu"))
    ratio = (plain / scaled).tolist()
    assert ratio[0] == 1 and 1 < ratio[1] < ratio[2] < 8 and ratio[3:] == [8] * 5


def test_phi3s_longrope_is_served_within_its_original_context(tiny_phi3_path):
    """Past its original context transformers recomputes a sequence on the long factors, which a
    KV cache cannot: the tiny Phi-4-mini's context is its original 256, on the short factors, 12
    of its 16 head dims turned. Phi-3.5-mini's config.json as released (`rope_scaling`, the
    original context beside it) reads so too."""
    from transformers import Phi3Config

    from freetoken.config import native_context
    from freetoken.layers.rotary import LongRope

    loaded = load_model(tiny_phi3_path, dtype="float32", device="cpu")
    assert loaded.max_model_len == 256 and loaded.model.cfg.rope_scaling.short_factor[-1] == 9.0
    assert loaded.model.cfg.rotary_dim == 12
    factors = {"short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}
    fields = dict(vocab_size=64, hidden_size=8, intermediate_size=16, num_attention_heads=2, num_hidden_layers=1,
                  max_position_embeddings=131072, original_max_position_embeddings=4096, rms_norm_eps=1e-5)
    released = {**fields, "rope_theta": 10000.0, "rope_scaling": {"type": "longrope", **factors}}
    current = Phi3Config(**fields, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **factors}).to_dict()
    assert ModelConfig.from_hf(released) == ModelConfig.from_hf(current)
    assert ModelConfig.from_hf(released).rope_scaling == LongRope((1.0, 2.0), (1 + math.log(32) / math.log(4096)) ** 0.5)
    assert native_context(released) == native_context(current) == 4096


def test_batch_of_8_matches_transformers_and_each_alone(on_harmony):
    assert_batch_matches_alone_and_reference(on_harmony, HARMONY_TEXTS)


def test_prefix_hit_and_chunked_prefill_give_the_cold_result(on_harmony):
    assert_harmony_cache_hit_and_chunks(on_harmony)


@pytest.mark.parametrize("name, builder, as_arch", [
    ("tiny-mistral-gguf", "build_mistral_gguf", "LlamaForCausalLM"),
    ("tiny-llama3-gguf", "build_llama3_gguf", "LlamaForCausalLM"),
    ("tiny-phi3-gguf", "build_phi3_gguf", "Phi3ForCausalLM")])
def test_a_gguf_as_llama_cpp_writes_it_loads_as_its_hf_folder(name, builder, as_arch):
    """llama.cpp writes a Mistral as a `llama` GGUF (q/k rows permuted; read in place), a Llama
    3.1 so with its schedule as a `rope_freqs` tensor (which transformers' parse drops) and a
    Phi-3 as a `phi3` one (q/k/v and gate/up fused, read as stored; its window a key, read into
    the config our code builds): each runs as its HF folder does, which matches transformers."""
    from tests.fixtures import build_models as bm

    built = bm.cached(name, getattr(bm, builder))
    from_gguf = load_model(built / "model.gguf", dtype="float32", device="cpu")
    from_folder = load_model(built / "hf", dtype="float32", device="cpu")
    assert from_gguf.hf_config["architectures"] == [as_arch]
    assert from_gguf.model.cfg.sliding_window == from_folder.model.cfg.sliding_window
    prompt = from_folder.tokenizer.encode(HARMONY_TEXTS[0])
    runs = [greedy_run(build_scheduler(loaded, kv_slots=256), {0: prompt}, steps=8)[0][0]
            for loaded in (from_gguf, from_folder)]
    assert_same_run(*runs, tol=1e-6)
    assert_matches_reference(built / "hf", prompt, runs[1])


@pytest.mark.parametrize("family, mix, formats", [
    ("phi3", "Q8_0", {"Q8_0", "float32"}), ("phi3", "Q4_K_M", {"Q4_K", "Q5_K", "Q6_K", "float32"}),
    ("smollm3", "Q8_0", {"Q8_0", "float32"}), ("smollm3", "Q4_K_M", {"Q4_K", "Q6_K", "float32"})])
def test_phi3_and_smollm3_ggufs_keep_their_blocks_and_match_transformers_on_them(family, mix, formats):
    """llama.cpp's `phi3` file (q/k/v and gate/up fused as stored; Phi-4-mini's longrope factors
    as tensors, its scale and original context as keys) and `smollm3` file (q/k rows permuted,
    no key for its unrotated layers): configs built by our code, blocks kept as stored, against
    transformers on their dequantized values. Phi-4-mini's prompts stay within its original
    context of 128, where transformers turns q and k by the short factors (past it, the long
    ones over the whole sequence, which a KV cache cannot: served within it)."""
    from freetoken.layers.quantized import QuantizedLinear

    loaded = assert_family_gguf_matches_reference(f"tiny-{family}-{mix}", formats)
    cfg, layer = loaded.model.cfg, loaded.model.model.layers[0]
    if family == "smollm3":
        assert cfg.unrotated_layers == {3} and not cfg.sliding_layers and cfg.tie_word_embeddings
        return
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and len(qkv.parts) == 1
    assert qkv.parts[0].qtype.name == ("Q8_0" if mix == "Q8_0" else "Q5_K")
    if mix == "Q8_0":  # Phi-3-mini-4k: every layer in its window
        assert cfg.sliding_window == 8 and cfg.sliding_layers == {0, 1} and cfg.rope_scaling is None
        return
    rope = loaded.hf_config["rope_parameters"]
    assert loaded.max_model_len == 128 and cfg.rotary_dim == 48 and cfg.sliding_window is None
    assert cfg.rope_scaling.short_factor == pytest.approx([1 + 0.4 * i for i in range(24)])
    assert rope["long_factor"] == pytest.approx([1 + 2.0 * i for i in range(24)])
    assert cfg.rope_scaling.attention_factor == pytest.approx((1 + math.log(8) / math.log(128)) ** 0.5)


@pytest.mark.parametrize("mix, formats", [("Q8_0", {"Q8_0", "float32"}),
                                          ("Q4_K_M", {"Q4_K", "Q6_K", "float32"})])
def test_a_granite_gguf_keeps_its_blocks_and_matches_transformers_on_them(mix, formats):
    """llama.cpp's `granite` file (q/k rows permuted as a llama's, the four scales as keys, the
    head tied): its config built by our code (transformers' GGUF parse has none), its blocks
    kept as stored, against transformers' Granite on their dequantized values."""
    loaded = assert_family_gguf_matches_reference(f"tiny-granite-{mix}", formats)
    cfg = loaded.model.cfg
    assert loaded.hf_config["architectures"] == ["GraniteForCausalLM"] and cfg.tie_word_embeddings
    scales = (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale, cfg.logits_scaling)
    assert scales == pytest.approx((12.0, 0.22, 1 / 32, 6.0)) and cfg.attention_scale != cfg.head_dim ** -0.5


@pytest.mark.parametrize("path", ["tiny_smollm3_path", "tiny_phi3_path"])
def test_on_the_grouped_kernel_smollm3_and_phi4_mini_match_transformers(path, request, monkeypatch):
    """On the grouped kernel every SmolLM3 layer, the unrotated one too, runs in decoder_layer.c's
    one call a step (kernels/decoder_layer.py), where the machine has the C kernels;
    Phi-4-mini's rotary on part of each head the C layer does not compute: the plan keeps its
    layers in Python."""
    from freetoken.kernels import decoder_layer

    if decoder_layer.load() is None:
        pytest.skip("no C kernels on this machine")
    on_grouped = load_model(request.getfixturevalue(path), dtype="float32", device="cpu",
                            weights=WeightsConfig(linear_kernel="grouped"))
    assert_batch_matches_alone_and_reference(on_grouped, HARMONY_TEXTS[:4])
    whole = path == "tiny_smollm3_path"
    assert all((layer.one_call is not None) == whole for layer in on_grouped.model.model.layers)
    assert (on_grouped.model.model.stack is not None) == whole
    assert on_grouped.model.kernel_plan.ops["layer"].startswith("decoder_layer.c") == whole
