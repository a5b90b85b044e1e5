"""One derivation of each configuration value, seen alike by the frontend and the engine."""

from __future__ import annotations

import json

import pytest

from freetoken.config import engine_config, frontend_config
from freetoken.models.registry import load_model
from freetoken.scheduler.factory import build_scheduler
from freetoken.serving.args import parse_args
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
