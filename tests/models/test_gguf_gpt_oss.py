"""gpt-oss GGUF files as llama.cpp's converter writes them, read as stored: the MXFP4 experts kept
in their blocks (the quantized grouped kernel) beside their F32 biases, the rest F32 or, as
released, the embedding, attention and head Q8_0; against transformers' float32 run on the
file's blocks dequantized by the gguf package (the fixture's `ref` folder: transformers' own
GGUF loader reads neither gpt-oss's split experts nor its sinks), batch invariance, and the
config and tokenizer (chat template, stop tokens) the file carries."""

from __future__ import annotations

import json

import pytest

from freetoken.config import WeightsConfig
from freetoken.models import loader, registry
from freetoken.layers.moe import Experts
from freetoken.layers.quantized import QuantizedEmbedding, QuantizedLinear
from tests.fixtures import build_models as bm
from tests.model_fixtures import assert_matches_reference, assert_same_run, greedy_run, stored_bytes

# Longer than the sliding window of 8, so layer 0 attends to a window.
PROMPTS = {0: [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], 1: [100, 200, 300], 2: list(range(400, 420))}


# bm.GGUF_FILES' gpt-oss files: the rest F32, and as released (Q8_0 embedding, attention, head).
LAYOUTS = ("tiny-gpt-oss-gguf", "tiny-gpt-oss-gguf-released")
BLOCKS = ("MXFP4", "Q8_0")  # the formats they hold as stored


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request):
    return request.param


@pytest.fixture(scope="module")
def built(layout):
    return bm.cached_gguf(layout)


@pytest.fixture(scope="module")
def loaded(built):
    """Loaded with exactly the memory its weights take once loaded available: the memory check
    must plan the experts kept as MXFP4 beside their F32 biases."""
    fits = sum(stored_bytes(built / "model.gguf", BLOCKS).values())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "available_memory", lambda: fits)
        return registry.load_model(built / "model.gguf", dtype="float32", device="cpu", weights=WeightsConfig(gguf_weights="quantized"))


def test_config_and_tokenizer_are_the_checkpoints(built, loaded):
    from transformers import AutoTokenizer

    ref = json.loads((built / "ref" / "config.json").read_text())
    for key in ("head_dim", "sliding_window", "layer_types", "num_local_experts", "intermediate_size",
                "vocab_size", "swiglu_limit"):
        assert loaded.hf_config[key] == ref[key], key
    assert {k: loaded.hf_config["rope_parameters"][k] for k in ref["rope_parameters"]} == ref["rope_parameters"]
    hf = AutoTokenizer.from_pretrained(built / "ref")
    assert loaded.eos_token_ids == sorted(hf.convert_tokens_to_ids(["<|return|>", "<|call|>"]))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, who are you?"}]
    assert loaded.tokenizer.apply_chat_template(chat, add_generation_prompt=True) == \
        hf.apply_chat_template(chat, add_generation_prompt=True)


def test_mxfp4_experts_stay_quantized_match_transformers_and_run_alike_alone(layout, built, loaded):
    from freetoken.scheduler.factory import build_scheduler

    layers = [m for m in loaded.model.modules() if isinstance(m, Experts)]
    assert len(layers) == 2 and all(m.experts is None for m in layers)
    held = layers[0].quantized
    assert [(w.qtype.name, tuple(w.shape)) for w in held.weights] == [("MXFP4", (8, 64, 64))] * 3
    assert tuple(held.gate_up_bias.shape) == (8, 128) and tuple(held.down_bias.shape) == (8, 64)
    released = layout.endswith("-released")
    # The head too quantized (a layer without a float weight) when released.
    assert isinstance(loaded.model.lm_head, QuantizedLinear) == released
    assert isinstance(loaded.model.model.embed_tokens, QuantizedEmbedding) == released
    stored = stored_bytes(built / "model.gguf", BLOCKS)
    assert set(stored) == ({"MXFP4", "Q8_0", "float32"} if released else {"MXFP4", "float32"})
    assert loaded.model.weight_bytes == stored
    together, _ = greedy_run(build_scheduler(loaded, kv_slots=256, prefix_cache=False), PROMPTS, steps=8)
    for uid, ids in PROMPTS.items():
        assert_matches_reference(built / "ref", ids, together[uid])
        alone, _ = greedy_run(build_scheduler(loaded, kv_slots=256, prefix_cache=False), {uid: ids}, steps=8)
        assert_same_run(together[uid], alone[uid], tol=0.0)
