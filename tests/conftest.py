"""Session-wide fixtures (paths of the tiny model folders, built once and cached) and the check
that every test loading the default model or starting a server is marked `slow`.

Each folder lives under ~/.cache/freetoken/test-models/<name>-<content hash> (root overridable
with $FREETOKEN_TEST_MODELS), so only the first run after a change to the builders pays for a
build; see tests/fixtures/build_models.py.
"""

from __future__ import annotations

import inspect
import os
import types
from pathlib import Path
from typing import Any, Callable

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The suite runs in two xdist workers (pyproject.toml) on CI's 2 cores: one OpenMP thread per
    # worker, and per server it starts (they inherit the environment), so that no process waits
    # at OpenMP barriers for a core another one holds. Set before anything imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The suite's ~100 loads (most of them the default model's, servers' too) keep a GGUF's blocks
# on the file's map: copying them into huge pages (models/huge_pages.py) costs each 0.3-1 s on a
# VM and changes no result; tests/models/test_huge_pages.py turns the copy on for its own tests.
os.environ.setdefault("FREETOKEN_HUGE_PAGES", "0")

from tests.fixtures import build_models as bm  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen3_path() -> Path:
    """Qwen3ForCausalLM (random, 2 layers) on the real Qwen3.5 vocabulary and chat template."""
    return bm.cached("tiny-qwen3", bm.build_tiny_qwen3)


@pytest.fixture(scope="session")
def tiny_qwen3_embedding_path() -> Path:
    """tiny-qwen3 laid out as Qwen3-Embedding: last-token pooling, Normalize, EOS appended."""
    return bm.cached("tiny-qwen3-embedding", bm.build_tiny_qwen3_embedding)


@pytest.fixture(scope="session")
def tiny_hybrid_path() -> Callable[[str], Path]:
    """`tiny_hybrid_path(variant)` -> folder of bm.build_tiny_hybrid: qwen3_5_text (default),
    qwen3_5_mtp (with an MTP head), qwen3_5 (image-text layout), qwen3_5_moe_text or qwen3_next,
    random, on the Qwen3.5 vocab."""

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
def tiny_mistral_path() -> Path:
    """MistralForCausalLM (random, 2 layers, both in a window of 8) on the Harmony tokenizer."""
    return bm.cached("tiny-mistral", bm.build_tiny_mistral)


@pytest.fixture(scope="session")
def tiny_smollm3_path() -> Path:
    """SmolLM3ForCausalLM (random, 4 layers, the last without rotary) on the Harmony tokenizer."""
    return bm.cached("tiny-smollm3", bm.build_tiny_smollm3)


@pytest.fixture(scope="session")
def tiny_llama3_path() -> Path:
    """LlamaForCausalLM (random, 2 layers) with the `llama3` rotary schedule, on the Harmony tokenizer."""
    return bm.cached("tiny-llama3", bm.build_tiny_llama3)


@pytest.fixture(scope="session")
def tiny_granite_path() -> Path:
    """GraniteForCausalLM (random, 2 layers, its four scales) on the Harmony tokenizer."""
    return bm.cached("tiny-granite", bm.build_tiny_granite)


@pytest.fixture(scope="session")
def tiny_phi3_path() -> Path:
    """Phi3ForCausalLM (random, 2 layers, fused projections, a window of 8, rotary on 3/4 of each
    head, longrope over an original context of 256: Phi-4-mini's) on the Harmony tokenizer."""
    return bm.cached("tiny-phi3", bm.build_tiny_phi3)


@pytest.fixture(scope="session")
def tiny_gemma3_path() -> Path:
    """Gemma3ForCausalLM (random, 4 layers: sliding in a window of 8 and global in turn, each
    kind on its own rotary schedule, the global one linearly scaled) on the Harmony tokenizer."""
    return bm.cached("tiny-gemma3", bm.build_tiny_gemma3)


@pytest.fixture(scope="session")
def tiny_deepseek_v3_path() -> Path:
    """DeepseekV3ForCausalLM (random, 3 layers: multi-head latent attention, the first dense,
    then sigmoid-routed experts with a correction bias) on the Harmony tokenizer."""
    return bm.cached("tiny-deepseek-v3", bm.build_tiny_deepseek_v3)


@pytest.fixture(scope="session")
def tiny_glm4_moe_path() -> Path:
    """Glm4MoeForCausalLM (random, 3 layers: one dense, then 8 experts in 4 groups with a shared
    one; a correction bias, q/k/v biases, q/k norm, rotary on half of each head; an MTP layer
    beside) on the Harmony tokenizer."""
    return bm.cached("tiny-glm4-moe", bm.build_tiny_glm4_moe)


@pytest.fixture(scope="session")
def tiny_gpt_oss_path() -> Path:
    """GptOssForCausalLM (random, 2 layers, window 8, 8 experts) on the Harmony tokenizer."""
    return bm.cached("tiny-gpt-oss", bm.build_tiny_gpt_oss)


@pytest.fixture(scope="session")
def tiny_gpt_oss_mxfp4_path() -> Path:
    """The tiny gpt-oss with experts of 64 stored in MXFP4, as gpt-oss releases them."""
    return bm.cached("tiny-gpt-oss-mxfp4", bm.build_tiny_gpt_oss, mxfp4=True)


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


# What loads the default model or starts a server. A test that reaches one (in its own body, a
# fixture of its closure, or a helper function of its own module) must be marked `slow`, so that
# `-m "not slow"` stays the fast part of the suite.
_SLOW_NAMES = frozenset({"default_model", "default_folder", "LLM", "Server"})
_SLOW_FIXTURES = frozenset({"server"})  # tests/e2e/conftest.py's factory


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names `code` and the functions nested in it refer to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _reaches_slow(func: Callable, module: str, seen: set) -> bool:
    """Whether `func`, or a function of `module` it names (recursively), names a _SLOW_NAMES."""
    func = inspect.unwrap(func)
    code = getattr(func, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    names = _names(code)
    if names & _SLOW_NAMES:
        return True
    helpers = (getattr(func, "__globals__", {}).get(name) for name in names)
    return any(_reaches_slow(h, module, seen) for h in helpers
               if inspect.isfunction(h) and h.__module__ == module)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("slow") is not None or not isinstance(item, pytest.Function):
        return
    seen: set = set()
    fixtures = [d.func for name in item.fixturenames
                for d in item._fixtureinfo.name2fixturedefs.get(name, ())]
    if _SLOW_FIXTURES & set(item.fixturenames) or any(
            _reaches_slow(f, f.__module__, seen) for f in [item.function, *fixtures]):
        pytest.fail(f"{item.nodeid} loads the default model or starts a server: mark it "
                    "@pytest.mark.slow (or the module, pytestmark = pytest.mark.slow)",
                    pytrace=False)
