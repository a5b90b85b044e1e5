"""A decoder layer in one C call (and a model's layers in one, where every layer runs so) gives the
bits of the Python layer: logits and the KV pool, over a step that holds prompt and decoding rows
together, on tiny quantized GGUFs (llama with a Python-path layer beside it, Qwen3's q/k norms,
Qwen2's biases, a sliding-window layer, a layer without rotary embedding) and on tiny checkpoints with their linears on the grouped
kernel (float32, bfloat16; Granite's scaled attention and residual adds too) and the bfloat16 units' (AMX, AVX512-BF16)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType

from freetoken.config import WeightsConfig
from freetoken.engine.engine import Engine, StepPlan
from freetoken.models import registry
from freetoken.kernels import bf16_linear, decoder_layer, int8
from freetoken.kernels.quant import QuantizedWeight
from freetoken.kernels.plan import available
from freetoken.models.registry import load_model
from tests.fixtures import build_models as bm
from tests.model_fixtures import tiny_random_folder

pytestmark = pytest.mark.skipif(decoder_layer.load() is None, reason="no C kernels on this machine")

PROMPT = list(range(1, 8))  # request A's slots, then its decoded token's
SECOND = list(range(20, 25))  # request B's prompt slots
LONG = list(range(30, 100))  # request C's: 70 rows, enough for the layer's row-parallel KV writes


def steps(model, engine: Engine) -> tuple[list[torch.Tensor], object]:
    """A's prompt alone, then A decoding beside B's prompt, then C's long prompt alone, from an
    empty pool: the steps' logits and the pool after them, and the second step's context."""
    for cache in engine.kv.kv:
        cache.zero_()
    plans = [StepPlan([5, 6, 7, 8, 9, 10, 11], list(range(7)), PROMPT, [6], [(0, 7, PROMPT)], []),
             StepPlan([3, 100, 200, 300, 400, 12], [7, 0, 1, 2, 3, 4], [8, *SECOND], [0, 5],
                      [(1, 5, SECOND)], [(0, [*PROMPT, 8])]),
             StepPlan([7 + i % 40 for i in range(len(LONG))], list(range(len(LONG))), LONG,
                      [len(LONG) - 1], [(0, len(LONG), LONG)], [])]
    with torch.inference_mode():
        contexts = [engine.context(plan) for plan in plans]
        logits = [model(None, ctx) for ctx in contexts]
    return logits + [cache.clone() for cache in engine.kv.kv], contexts[1]


@pytest.mark.parametrize("arch, layer0", [("llama", None), ("llama", "sliding"), ("llama", "unrotated"),
                                         ("qwen3", None), ("qwen2", None)])
def test_a_layer_in_one_call_gives_the_python_layers_bits(arch, layer0):
    path = bm.cached_gguf(f"tiny-quantized-{arch}")
    # The llama file's layer 1 has a Q5_0 projection (no kernel: dequantized at load), kept on
    # F.linear here (where the probe picks the grouped kernel, that layer runs as one call too).
    model = registry.load_model(path / "model.gguf", dtype="float32", device="cpu",
                                weights=WeightsConfig(gguf_weights="quantized", linear_kernel="torch")).model
    if layer0 == "sliding":  # over its last 3 keys
        model.cfg = dataclasses.replace(model.cfg, sliding_window=3, sliding_layers=frozenset({0}))
        model.model.layers[0].self_attn.sliding = True
    if layer0 == "unrotated":  # as SmolLM3's NoPE layers
        model.model.layers[0].self_attn.rotary = False
    model.model.plan_kernels(available(), torch.float32, "cpu")  # the layer calls made anew for it
    assert_same_bits(model, torch.float32, [True, arch != "llama"])


@pytest.mark.parametrize("arch, dtype, kernel", [("qwen2", torch.float32, "grouped"),
                                                 ("qwen2", torch.bfloat16, "grouped"),
                                                 ("granite", torch.float32, "grouped"),
                                                 ("granite", torch.bfloat16, "grouped"),
                                                 ("qwen3", torch.bfloat16, "amx"),
                                                 ("qwen3", torch.bfloat16, "avx512_bf16")])
def test_a_layer_on_our_dense_kernels_in_one_call_gives_the_python_layers_bits(arch, dtype, kernel):
    if kernel in bf16_linear.UNITS and not bf16_linear.available(kernel):
        pytest.skip(f"this CPU has no {kernel} unit")
    folder = bm.cached("tiny-granite", bm.build_tiny_granite) if arch == "granite" else tiny_random_folder(arch)
    model = load_model(folder, dtype=str(dtype).removeprefix("torch."), device="cpu",
                       weights=WeightsConfig(linear_kernel=kernel)).model
    assert_same_bits(model, dtype, [True, True])


@pytest.mark.parametrize("fixture, arithmetic", [("tiny-quantized-moe-Q8_0", "exact"),
                                                 ("tiny-quantized-moe-Q4_K_M", "exact"),
                                                 ("tiny-quantized-moe-Q8_0", "int8"),
                                                 ("tiny-quantized-moe-Q4_K_M", "int8"),
                                                 ("tiny-qwen3-moe", "exact"),
                                                 ("tiny-gpt-oss-gguf", "exact"),
                                                 ("tiny-gpt-oss-gguf-released", "int8"),
                                                 ("tiny-gpt-oss", "exact")])
def test_a_sparse_layer_in_one_call_gives_the_python_layers_bits(fixture, arithmetic):
    # Qwen3-MoE and gpt-oss (sinks, sliding layers, the router's and experts' biases, its route
    # and clamped SwiGLU): the router, route, experts (quantized, on int8's arithmetic, or float32
    # on the grouped kernel) and weighted sum inside the call; a step of 1, 6 and 70 rows.
    builders = {"tiny-qwen3-moe": bm.build_tiny_qwen3_moe, "tiny-gpt-oss": bm.build_tiny_gpt_oss}
    folder = bm.cached(fixture, builders[fixture]) if fixture in builders else bm.cached_gguf(fixture) / "model.gguf"
    if arithmetic == "int8" and not int8.supported(QuantizedWeight(GGMLQuantizationType.Q8_0,
                                                                   torch.zeros(1, 34, dtype=torch.uint8), (1, 32))):
        pytest.skip("int8_gemm.c is not built here")
    model = load_model(folder, dtype="float32", device="cpu",
                       weights=WeightsConfig(quantized_arithmetic=arithmetic, linear_kernel="grouped")).model
    sparse = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "one_call")]
    assert len(sparse) >= 2 and all(mlp.one_call(lambda module: None) is None for mlp in sparse)  # no router run
    assert model.kernel_plan.ops["moe_route"] == "grouped_gemm.c moe_route_f32"
    assert_same_bits(model, torch.float32, [True] * len(model.model.layers))


def assert_same_bits(model, dtype: torch.dtype, one_call: list[bool]) -> None:
    engine = Engine(model, 128, torch.device("cpu"), dtype)
    fast, ctx = steps(model, engine)
    assert ctx.layer_step
    assert [layer.one_call is not None for layer in model.model.layers] == one_call
    # Every layer one call, all of one shape (scratch): all in one.
    layers = model.model.layers
    assert (model.model.stack is not None) == (all(one_call) and len({layer.one_call.shape for layer in layers}) == 1)
    # Planned as under FREETOKEN_LAYER_KERNEL=0: every layer on the Python path.
    assert model.kernel_plan.ops["layer"].startswith("decoder_layer.c")
    assert model.model.plan_kernels(dataclasses.replace(available(), layer=None), dtype, "cpu") == {"layer": "Python"}
    python, ctx = steps(model, engine)
    assert ctx.layer_step is None and all(layer.one_call is None for layer in model.model.layers)
    assert all(torch.equal(a, b) for a, b in zip(fast, python))
