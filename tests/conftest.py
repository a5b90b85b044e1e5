"""Session-wide fixtures: paths of the tiny model folders, built once and cached.

Each folder lives under ~/.cache/freetoken/test-models/<name>-<content hash> (root overridable
with $FREETOKEN_TEST_MODELS), so only the first run after a change to the builders pays for a
build; see tests/fixtures/build_models.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The suite runs in two xdist workers (pyproject.toml) on CI's 2 cores: one OpenMP thread per
    # worker, and per server it starts (they inherit the environment), so that no process waits
    # at OpenMP barriers for a core another one holds. Set before anything imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.fixtures import build_models as bm  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen3_path() -> Path:
    """Qwen3ForCausalLM (random, 2 layers) on the real Qwen3.5 vocabulary and chat template."""
    return bm.cached("tiny-qwen3", bm.build_tiny_qwen3)


@pytest.fixture(scope="session")
def tiny_hybrid_path() -> Callable[[str], Path]:
    """`tiny_hybrid_path(variant)` -> folder of bm.build_tiny_hybrid: qwen3_5_text (default),
    qwen3_5 (image-text layout), qwen3_5_moe_text or qwen3_next, random, on the Qwen3.5 vocab."""

    def get(variant: str = "qwen3_5_text") -> Path:
        return bm.cached(f"tiny-{variant}", bm.build_tiny_hybrid, variant)

    return get


@pytest.fixture(scope="session")
def tiny_harmony_path() -> Path:
    """LlamaForCausalLM (random, 2 layers) with a Harmony (gpt_oss) tokenizer and template."""
    return bm.cached("tiny-gpt-oss-harmony", bm.build_tiny_harmony)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_path() -> Path:
    """Qwen3MoeForCausalLM (random, 3 layers, 8 experts) on the real Qwen3.5 vocabulary."""
    return bm.cached("tiny-qwen3-moe", bm.build_tiny_qwen3_moe)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_path() -> Path:
    """Qwen2MoeForCausalLM (random, 3 layers, 8 experts and a shared one, q/k/v biases)."""
    return bm.cached("tiny-qwen2-moe", bm.build_tiny_qwen3_moe, family="qwen2_moe")


@pytest.fixture(scope="session")
def tiny_gpt_oss_path() -> Path:
    """GptOssForCausalLM (random, 2 layers, window 8, 8 experts) on the Harmony tokenizer."""
    return bm.cached("tiny-gpt-oss", bm.build_tiny_gpt_oss)


@pytest.fixture(scope="session")
def make_scripted_model() -> Callable[..., Path]:
    """`make_scripted_model(outputs, **opts)` -> cached folder of `bm.build_scripted`."""

    def make(outputs: list[dict[str, Any]], **opts: Any) -> Path:
        return bm.cached("scripted-qwen3", bm.build_scripted, outputs, **opts)

    return make


@pytest.fixture(scope="session")
def scripted_model_path(make_scripted_model: Callable[..., Path]) -> Path:
    """ScriptedForCausalLM with bm.DEFAULT_SCRIPT; alternatives </think> 8.0, "\\n\\n" 6.0."""
    return make_scripted_model(bm.DEFAULT_SCRIPT, alternatives=bm.DEFAULT_ALTERNATIVES)


@pytest.fixture(scope="session")
def qwen35_tokenizer(tiny_qwen3_path: Path) -> Any:
    """The Qwen3.5 tokenizer of the fixtures, loaded once (a load takes about 2 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_qwen3_path))
