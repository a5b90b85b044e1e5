"""Gemma 3 (models/gemma3.py) against transformers on the same weights: the tiny Gemma3ForCausalLM
(five sliding layers in a window of 8, shorter than the prompts, on a rotary base of their own,
a global one on a linear schedule, zero-centred norms, a scores' scale other than its head
width) batched and each alone, after a prefix-cache hit and in prefill chunks; its config as
released; the Q8_0 GGUF llama.cpp makes of it, a Q4_K_M one; its image-text layout's language
model."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import WeightsConfig
from freetoken.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from freetoken.layers.rotary import LinearScaling
from freetoken.models.registry import load_model
from freetoken.scheduler.factory import build_scheduler
from tests.fixtures import build_models as bm
from tests.model_fixtures import (HARMONY_TEXTS, assert_batch_matches_alone_and_reference,
                                  assert_harmony_cache_hit_and_chunks, assert_holds_stored_bytes_and_matches_reference,
                                  assert_matches_reference, greedy_run, stored_bytes)


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3_path):
    return load_model(tiny_gemma3_path, dtype="float32", device="cpu")


def test_five_of_six_layers_slide_and_every_layer_runs_in_python(gemma3):
    """The decoder layer's C call computes the llama layer (no post-norms, no GeGLU): never made
    for Gemma's."""
    cfg = gemma3.model.cfg
    assert cfg.sliding_layers == {0, 1, 2, 3, 4} and cfg.sliding_window == 8
    assert min(len(gemma3.tokenizer.encode(t)) for t in HARMONY_TEXTS) > cfg.sliding_window
    assert (cfg.rope_scaling, cfg.local_rope_theta, cfg.attention_scale) == (LinearScaling(8.0), 1e4, 24 ** -0.5)
    assert all(layer.prepared_call() is None for layer in gemma3.model.model.layers)
    greedy_run(build_scheduler(gemma3, kv_slots=64), {0: gemma3.tokenizer.encode("Hi")}, steps=1)
    assert gemma3.model.model.stack is None


def test_batch_of_8_matches_transformers_and_each_alone(gemma3):
    assert_batch_matches_alone_and_reference(gemma3, HARMONY_TEXTS)


def test_prefix_hit_and_chunked_prefill_give_the_cold_result(gemma3):
    assert_harmony_cache_hit_and_chunks(gemma3)


def test_gemma3_4bs_config_as_released_reads_as_transformers_5_writes_it():
    """gemma-3-4b-it's text config.json (transformers 4's layout: the global layers' `rope_scaling`,
    `rope_local_base_freq`, `sliding_window_pattern`, no `layer_types`, no tie named) reads as
    transformers 5's Gemma3TextConfig of it (the schedules nested by layer type)."""
    from transformers import Gemma3TextConfig

    fields = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_hidden_layers=12, sliding_window=1024, query_pre_attn_scalar=256,
                  max_position_embeddings=131072)
    old = dict(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window_pattern=6)
    released = Gemma3Config.from_hf({**fields, **old, "architectures": ["Gemma3ForCausalLM"]})
    current = Gemma3TextConfig(**fields, **old).to_dict()
    assert "layer_types" in current and "rope_local_base_freq" not in current
    assert released == Gemma3Config.from_hf({**current, "architectures": ["Gemma3ForCausalLM"]})
    assert released.sliding_layers == set(range(12)) - {5, 11} and released.tie_word_embeddings
    assert (released.rope_theta, released.rope_scaling, released.local_rope_theta) == (1e6, LinearScaling(8.0), 1e4)


def test_a_q8_0_gguf_as_llama_cpp_writes_it_matches_transformers_on_its_weights(gemma3):
    """llama.cpp's gemma3 file: norms stored plus 1, the embedding (the tied head) and layers in
    Q8_0 blocks kept as stored; the scaling, window and the attention scale llama.cpp assumes
    (which transformers' parse leaves out) in the config; against transformers on the blocks'
    dequantized weights."""
    built = bm.cached("tiny-gemma3-gguf", bm.build_gemma3_gguf)
    loaded = load_model(built / "model.gguf", dtype="float32", device="cpu")
    cfg = loaded.model.cfg
    assert loaded.hf_config["architectures"] == ["Gemma3ForCausalLM"] and cfg.sliding_layers == {0, 1, 2, 3, 4}
    assert (cfg.rope_scaling, cfg.local_rope_theta, cfg.attention_scale) == (LinearScaling(8.0), 1e4, 16 ** -0.5)
    assert set(loaded.model.weight_bytes) == {"Q8_0", "float32"}  # the norms in float32
    # The folder's tokenizer: the file's BPE is a stand-in, which transformers reads as Gemma's SentencePiece.
    prompts = {uid: gemma3.tokenizer.encode(text) for uid, text in enumerate(HARMONY_TEXTS[:4])}
    together, _ = greedy_run(build_scheduler(loaded, kv_slots=512, prefix_cache=False), prompts, steps=8)
    for uid, ids in prompts.items():
        assert_matches_reference(built / "ref", ids, together[uid])


def test_q4_k_m_blocks_stay_quantized_and_match_transformers_on_the_file():
    """A gemma3 file of Q4_K_M's two formats (random blocks, hidden 256: a K-quant's block), its
    norms plus 1: held as stored, against transformers' conversion of the same file (whose
    config gets the attention scale llama.cpp assumes, 1 / sqrt(64), not transformers' 256)."""
    built = bm.cached_gguf("tiny-quantized-gemma3")
    loaded = load_model(built / "model.gguf", dtype="float32", device="cpu",
                        weights=WeightsConfig(gguf_weights="quantized"))
    assert loaded.model.cfg.attention_scale == 64 ** -0.5
    stored = stored_bytes(built / "model.gguf", bm.GGUF_FORMATS)
    assert set(stored) == {"Q4_K", "Q6_K", "float32"}
    assert_holds_stored_bytes_and_matches_reference(loaded, stored, {0: list(range(5, 16)), 1: [100, 200, 300]})


def test_the_image_text_layout_serves_its_language_model(gemma3):
    """Gemma3ForConditionalGeneration as released: its language model's names mapped, the vision
    tower and projector not read; its runs are the text-only checkpoint's (the same builder's
    weights), bit for bit, and transformers' image-text class's (text only)."""
    folder = bm.cached("tiny-gemma3-image-text", bm.build_tiny_gemma3_image_text)
    image_text, text = load_model(folder, dtype="float32", device="cpu"), gemma3
    assert type(image_text.model) is Gemma3ForCausalLM
    prompts = {uid: text.tokenizer.encode(t) for uid, t in enumerate(HARMONY_TEXTS[:2])}
    runs = [greedy_run(build_scheduler(loaded, kv_slots=256), prompts, steps=8)[0] for loaded in (image_text, text)]
    assert runs[0] == runs[1]
    for uid, ids in prompts.items():
        assert_matches_reference(folder, ids, runs[0][uid])


def test_transformers_5s_image_text_names_map_too():
    """The names transformers 5 holds in memory (and may save): `model.language_model.*`."""
    with torch.device("meta"):
        model = Gemma3ForCausalLM.from_hf({"architectures": ["Gemma3ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                                          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
                                          "head_dim": 8})
    state = {"model.language_model.norm.weight": torch.zeros(2), "language_model.lm_head.weight": torch.ones(2)}
    assert {k: v.tolist() for k, v in model.convert_hf_weights(state).items()} == {
        "model.norm.weight": [1.0, 1.0], "lm_head.weight": [1.0, 1.0]}
    assert not model.reads("model.vision_tower.vision_model.post_layernorm.weight")
    assert not model.reads("multi_modal_projector.mm_soft_emb_norm.weight")
