"""One derivation of each configuration value, seen alike by the frontend and the engine."""

from __future__ import annotations

import json

import pytest

from freetoken.config import WeightsConfig, engine_config, frontend_config
from freetoken.models.registry import load_model
from freetoken.scheduler.factory import build_scheduler
from freetoken.serving.launch.args import parse_args
from tests.model_fixtures import tiny_random_folder


@pytest.fixture(scope="module")
def tiny():
    folder = tiny_random_folder("qwen3")
    return folder, load_model(folder, dtype="float32", device="cpu")


@pytest.mark.parametrize("flags,expected", [([], None), (["--max-model-len", "100"], 100),
                                            (["--max-model-len", "10000000"], None)])
def test_frontend_and_engine_see_the_same_context_length(tiny, flags, expected):
    folder, loaded = tiny
    args = parse_args([str(folder), "--kv-cache-tokens", "256", *flags])
    hf_config = json.loads((folder / "config.json").read_text())
    native = hf_config["max_position_embeddings"]  # read here, independently of the loader
    front = frontend_config(args, hf_config, "tiny", (None, None))
    scheduler = build_scheduler(loaded, engine_config(args, str(folder)))
    assert front.max_model_len == scheduler.config.max_model_len == (expected or native)
    assert scheduler.engine.kv.num_slots == 256


def test_the_weights_flags_reach_the_load_and_win_over_their_variables(tiny, monkeypatch):
    folder, _ = tiny
    args = parse_args([str(folder), "--gguf-weights", "float32", "--linear-kernel", "torch",
                       "--exact-tp", "off", "--huge-pages", "off", "--quantized-arithmetic", "int8"])
    weights = engine_config(args, str(folder)).weights
    assert weights == WeightsConfig(gguf_weights="float32", linear_kernel="torch", exact_tp=False,
                                    huge_pages=False, quantized_arithmetic="int8")
    # The frontend says so in every response (the scores a client gets are int8's).
    hf_config = json.loads((folder / "config.json").read_text())
    assert frontend_config(args, hf_config, "tiny", (None, None)).system_fingerprint == "quantized-arithmetic:int8"
    plain = parse_args([str(folder)])
    assert frontend_config(plain, hf_config, "tiny", (None, None)).system_fingerprint is None
    assert engine_config(plain, str(folder)).weights.quantized_arithmetic == "exact"
    monkeypatch.setenv("FREETOKEN_LINEAR_KERNEL", "grouped")
    monkeypatch.setenv("FREETOKEN_EXACT_TP", "1")
    monkeypatch.setenv("FREETOKEN_HUGE_PAGES", "0")
    assert weights.resolved() == weights
    assert WeightsConfig().resolved() == WeightsConfig(linear_kernel="grouped", exact_tp=True, huge_pages=False)
    loaded = load_model(folder, dtype="float32", device="cpu", weights=weights)
    assert all(kernel.startswith("torch") for kernel in loaded.model.kernel_plan.kernels.values())


def test_a_weights_value_outside_its_choices_is_refused_by_name(monkeypatch):
    with pytest.raises(SystemExit):
        parse_args(["--linear-kernel", "cublas"])
    with pytest.raises(SystemExit):
        parse_args(["--quantized-arithmetic", "int4"])
    with pytest.raises(ValueError, match="quantized_arithmetic=int4: not one of exact, int8"):
        WeightsConfig(quantized_arithmetic="int4")
    with pytest.raises(ValueError, match="linear_kernel=cublas: not one of onednn, torch"):
        WeightsConfig(linear_kernel="cublas")
    monkeypatch.setenv("FREETOKEN_LINEAR_KERNEL", "cublas")
    with pytest.raises(ValueError, match="FREETOKEN_LINEAR_KERNEL=cublas"):
        WeightsConfig().resolved()


def test_a_pooling_server_loads_its_head_for_label_columns(tiny):
    """--runner pooling (a reranker reads two ids of each logit row): the engine's load puts the
    LM head on a kernel that computes those columns alone, whatever this CPU's timings say."""
    import torch

    from freetoken.config import PoolingConfig
    from freetoken.layers.linear import Linear, prepare

    folder, _ = tiny
    args = parse_args([str(folder)])
    assert engine_config(args, str(folder)).weights.head_for_columns is False
    config = engine_config(args, str(folder), PoolingConfig(task="classify"))
    assert config.weights.head_for_columns is True
    loaded = load_model(folder, dtype="float32", device="cpu", weights=config.weights)
    head = loaded.model.lm_head
    if prepare("grouped", Linear(16, 16).requires_grad_(False)) is None:
        pytest.skip("our grouped kernel does not run float32 here")
    x = torch.randn(2, head.in_features)
    assert torch.equal(head.logits_at(x, [5, 9]), head(x)[:, [5, 9]])
