"""GGUF files read as stored: block formats kept quantized against transformers' float32 run on
the same file dequantized, batch-invariance, weight bytes, memory refusal and bad files."""

from __future__ import annotations

import logging
import struct

import pytest
import torch

from freetoken.config import WeightsConfig
from freetoken.models import files, loader, registry
from freetoken.distributed.parts import RowParts
from freetoken.layers.quantized import QuantizedEmbedding, QuantizedLinear
from freetoken.paths import ModelNotFound
from tests.fixtures import build_models as bm
from tests.model_fixtures import (assert_config_edit_is_named,
                                  assert_holds_stored_bytes_and_matches_reference, assert_same_run,
                                  greedy_run, stored_bytes)

# bm.GGUF_FILES' dense files, every block format in each.
MODELS = ("llama", "qwen3", "qwen2")
PROMPTS = {0: [5, 6, 7, 8, 9, 10, 11], 1: [100, 200, 300]}


@pytest.fixture(scope="module")
def built():
    return {arch: bm.cached_gguf(f"tiny-quantized-{arch}") for arch in MODELS}


@pytest.fixture(scope="module")
def loaded(built):
    return {arch: registry.load_model(path / "model.gguf", dtype="float32", device="cpu",
                                      weights=WeightsConfig(gguf_weights="quantized"))
            for arch, path in built.items()}


@pytest.mark.parametrize("arch", list(MODELS))
def test_block_formats_stay_quantized_and_match_transformers(arch, built, loaded):
    model = loaded[arch]
    assert isinstance(model.model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.model.lm_head, QuantizedLinear)
    qkv = model.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and len({p.qtype for p in qkv.parts}) == 3
    # Bytes by format as the file stores them (the F16 norm and Q5_0 layer widened to float32).
    stored = stored_bytes(built[arch] / "model.gguf", bm.GGUF_FORMATS)
    assert_holds_stored_bytes_and_matches_reference(model, stored, PROMPTS)


@pytest.mark.parametrize("arch", list(MODELS))
def test_batched_rows_equal_rows_alone_bit_for_bit(arch, loaded):
    from freetoken.scheduler.factory import build_scheduler

    model = loaded[arch]
    if not model.model.kernel_plan.invariant:
        pytest.skip(f"quant_linear's rows are not alike at every row count here: "
                    f"{model.model.kernel_plan.kernels}")
    together, _ = greedy_run(build_scheduler(model, kv_slots=256, prefix_cache=False), PROMPTS, steps=6)
    for uid, ids in PROMPTS.items():
        alone, _ = greedy_run(build_scheduler(model, kv_slots=256, prefix_cache=False), {uid: ids}, steps=6)
        assert_same_run(together[uid], alone[uid], tol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(bm.GGUF_FILES))
def test_the_memory_checks_plan_is_the_bytes_held_once_loaded(name, dtype):
    """The pre-flight plan, format by format, on every GGUF file the tests build: block formats
    kept as stored (gpt-oss's MXFP4 experts beside their F32 biases, which stay float32), the rest
    in the model's dtype."""
    from freetoken.models import gguf_file

    path = bm.cached_gguf(name) / "model.gguf"
    planned = gguf_file.planned_bytes(gguf_file.open_gguf(path), dtype, quantized=True)
    model = registry.load_model(path, dtype=str(dtype).removeprefix("torch."), device="cpu",
                                weights=WeightsConfig(gguf_weights="quantized"))
    assert model.model.weight_bytes == planned


def test_a_model_that_does_not_fit_is_refused_before_loading(built, monkeypatch):
    monkeypatch.setattr(loader, "available_memory", lambda: 1 << 20)
    monkeypatch.setattr("freetoken.models.gguf_file.read_tensors", _never)
    with pytest.raises(ModelNotFound, match=r"needs 0\.00 GiB of weights \+ 0\.50 GiB of KV pool, "
                                            r"but 0\.00 GiB of memory is available"):
        # 2 layers x 2 KV heads x 64 x (K and V) x 4 bytes = 2 KiB per slot
        registry.load_model(built["llama"] / "model.gguf", dtype="float32", device="cpu", kv_slots=1 << 18,
                            weights=WeightsConfig(gguf_weights="quantized"))


def _never(*args, **kwargs):
    raise AssertionError("weights read although the memory check refused the model")


def _tensor_info_offset(data: bytes, name: str) -> int:
    """Offset of a tensor's type field in a GGUF's tensor infos (name, n_dims, dims, type)."""
    at = data.index(name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return at + 4 + 8 * n_dims


def _bad_copy(built, tmp_path, edit) -> object:
    path = tmp_path / "bad.gguf"
    data = bytearray((built["llama"] / "model.gguf").read_bytes())
    path.write_bytes(edit(data))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda d: d[: len(d) - 100], r"the file ends inside tensor output_norm\.weight \(truncated"),
    (lambda d: d[:_tensor_info_offset(d, "blk.0.attn_k.weight")] + struct.pack("<I", 99)
     + d[_tensor_info_offset(d, "blk.0.attn_k.weight") + 4:], r"tensor blk\.0\.attn_k\.weight has an unknown tensor type 99"),
])
def test_a_bad_file_is_one_error_naming_the_tensor_with_nothing_cached(built, tmp_path, edit, message):
    path = _bad_copy(built, tmp_path, edit)
    with pytest.raises(ModelNotFound, match=f"bad.gguf: {message}") as err:
        registry.load_model(path, device="cpu")
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert not files.gguf_cache_folder(path, "config").exists() and not files.gguf_cache_folder(path).exists()


def test_a_tensor_that_does_not_fit_the_config_is_named(built, tmp_path):
    assert_config_edit_is_named(built["llama"] / "model.gguf", tmp_path, [(
        {'"intermediate_size": 512': '"intermediate_size": 384'},
        r"tensor blk\.0\.ffn_gate\.weight is \[512, 256\], the config says \[384, 256\]")])


@pytest.fixture(scope="module")
def split_qwen3():
    """tiny-quantized-qwen3's model split into 3 parts of 10 tensors, its untied head in the last."""
    return sorted(bm.cached_split_gguf().glob("model-*.gguf"))


def test_a_split_file_is_the_whole_file_bit_for_bit(split_qwen3, loaded):
    from gguf import GGUFReader

    from freetoken.scheduler.factory import build_scheduler

    assert [p.name for p in split_qwen3] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    first = GGUFReader(split_qwen3[0])
    assert all(t.name != "output.weight" for t in first.tensors)  # transformers' parse would tie it
    assert "split.count" in first.fields and "qwen3.block_count" not in GGUFReader(split_qwen3[1]).fields
    model = registry.load_model(split_qwen3[0], dtype="float32", device="cpu", weights=WeightsConfig(gguf_weights="quantized"))
    assert isinstance(model.model.lm_head, QuantizedLinear) and model.name == "model-00001-of-00003"
    assert model.model.weight_bytes == loaded["qwen3"].model.weight_bytes
    split, _ = greedy_run(build_scheduler(model, kv_slots=256), PROMPTS, steps=6)
    whole, _ = greedy_run(build_scheduler(loaded["qwen3"], kv_slots=256), PROMPTS, steps=6)
    for uid in PROMPTS:
        assert_same_run(split[uid], whole[uid], tol=0.0)


def test_a_split_file_is_named_by_its_first_part_and_whole(split_qwen3, tmp_path):
    with pytest.raises(ModelNotFound, match="is part 2 of a split GGUF: pass its first part, "
                       "model-00001-of-00003.gguf"):
        registry.load_model(split_qwen3[1], dtype="float32", device="cpu")
    for part in split_qwen3[:2]:
        (tmp_path / part.name).symlink_to(part)
    with pytest.raises(ModelNotFound, match="model-00003-of-00003.gguf not found beside it"):
        registry.load_model(tmp_path / split_qwen3[0].name, dtype="float32", device="cpu")


def test_a_gguf_caches_its_config_and_tokenizer_only(built):
    folder, name = registry.model_folder(built["qwen3"] / "model.gguf")
    assert name == "model" and (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert not list(folder.glob("*.safetensors"))
    assert files.gguf_source(folder) == (built["qwen3"] / "model.gguf").resolve()
    assert registry.model_folder(folder) == (folder, name)


def test_hybrids_read_the_float32_conversion(caplog):
    caplog.set_level(logging.INFO)
    assert not registry._reads_gguf("Qwen3NextForCausalLM")
    assert all(registry._reads_gguf(arch) for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM"))
    assert "transformers' conversion" in caplog.text


def test_row_parallel_layers_run_in_the_ranks_parts_by_default_only_where_that_is_free(built, loaded,
                                                                                      monkeypatch):
    # qwen3: every sliced layer on the quantized kernel, the parts whole blocks: each row-parallel
    # layer in the two ranks' parts of K, one kernel call (TP=1 has TP=2's bits).
    for layer in loaded["qwen3"].model.model.layers:
        assert all(isinstance(m, RowParts) and m.fused is not None
                   for m in (layer.self_attn.o_proj, layer.mlp.down_proj))
    # llama: a layer dequantized at load (a float Linear) would pay for its parts: all whole.
    assert not any(isinstance(m, RowParts) for m in loaded["llama"].model.modules())
    monkeypatch.setenv("FREETOKEN_EXACT_TP", "0")
    off = registry.load_model(built["qwen3"] / "model.gguf", dtype="float32", device="cpu",
                              weights=WeightsConfig(gguf_weights="quantized"))
    assert not any(isinstance(m, RowParts) for m in off.model.modules())


def test_float32_weights_are_the_dequantized_blocks(built, loaded, monkeypatch):
    """FREETOKEN_GGUF_WEIGHTS=float32: plain layers on the blocks dequantized at load, the same
    products as the quantized layers (which dequantize the same blocks) up to summation order."""
    widened = registry.load_model(built["qwen3"] / "model.gguf", dtype="float32", device="cpu",
                                  weights=WeightsConfig(gguf_weights="float32"))
    assert set(widened.model.weight_bytes) == {"float32"}
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj", "lm_head"):
        plain, kept = widened.model.get_submodule(name), loaded["qwen3"].model.get_submodule(name)
        # A row-parallel layer runs in the parts of K two ranks hold (by default: parts.free_in_parts).
        held = kept.parts if isinstance(kept, RowParts) else [kept]
        assert not isinstance(plain, QuantizedLinear) and all(isinstance(h, QuantizedLinear) for h in held)
        x = torch.randn(5, kept.in_features, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(plain(x), kept(x), rtol=0, atol=1e-5)
    monkeypatch.setenv("FREETOKEN_GGUF_WEIGHTS", "int3")
    with pytest.raises(ValueError, match="FREETOKEN_GGUF_WEIGHTS=int3: not one of quantized, float32"):
        registry.load_model(built["qwen3"] / "model.gguf", device="cpu")


def test_bfloat16_dequantizes_unless_asked_to_keep_the_blocks(built, monkeypatch):
    """The quantized kernels compute in float32: a bfloat16 load dequantizes the blocks (to run
    on the CPU's bfloat16 units), unless FREETOKEN_GGUF_WEIGHTS=quantized says otherwise."""
    monkeypatch.delenv("FREETOKEN_GGUF_WEIGHTS", raising=False)
    path = built["qwen3"] / "model.gguf"
    plain = registry.load_model(path, dtype="bfloat16", device="cpu")
    assert set(plain.model.weight_bytes) == {"bfloat16"}
    monkeypatch.setenv("FREETOKEN_GGUF_WEIGHTS", "quantized")
    kept = registry.load_model(path, dtype="bfloat16", device="cpu")
    assert isinstance(kept.model.get_submodule("model.layers.0.mlp.down_proj"), QuantizedLinear)


_EXPERTS = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32, "rope.dimension_count": 8}


@pytest.mark.parametrize("arch, keys, message", [
    ("granite", {"attention.sliding_window": 8}, r"granite\.attention\.sliding_window=8 is not supported"),
    ("granite", {"rope.dimension_count": 8}, r"granite\.rope\.dimension_count=8 \(rotary on part of each head\)"),
    ("glm4_moe", {**_EXPERTS, "expert_gating_func": 1}, r"glm4moe\.expert_gating_func=1 \(GLM-4\.5 routes by sigmoid"),
    ("deepseek2", _EXPERTS, r"a deepseek2 GGUF without deepseek2\.attention\.kv_lora_rank"),
    ("deepseek2", {**_EXPERTS, "attention.kv_lora_rank": 16, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                   "rope.scaling.original_context_length": 128}, r"YaRN without rope\.scaling\.yarn_log_multiplier"),
    ("deepseek2", {**_EXPERTS, "attention.kv_lora_rank": 16, "nextn_predict_layers": 1},
     r"deepseek2\.nextn_predict_layers=1 is not supported"),

    ("smollm3", {"attention.sliding_window": 8}, r"smollm3\.attention\.sliding_window=8 is not supported"),
    ("smollm3", {"rope.dimension_count": 8}, r"smollm3\.rope\.dimension_count=8 \(rotary on part of each head\)"),
    ("phi3", {"rope.scaling.attn_factor": 1.5}, r"phi3\.rope\.scaling\.attn_factor=1\.5 without longrope's factors"),
    ("phi3", {"rope.scaling.yarn_log_multiplier": 0.5}, r"phi3\.rope\.scaling\.yarn_log_multiplier=0\.5 is not"),
])
def test_a_family_gguf_key_freetoken_does_not_compute_is_refused_by_name(tmp_path, arch, keys, message):
    """The GGUF architectures whose configs our code builds (models/gguf_families.py): a key of
    theirs that the build does not read, or a value it does not compute, or a key it needs
    missing, is refused by name before anything loads."""
    path = bm.build_config_only_gguf(tmp_path, arch, keys) / "model.gguf"
    with pytest.raises(ModelNotFound, match=f"^model.gguf: .*{message}"):
        registry.model_folder(path)
