"""The load-time kernel plan (kernels/plan.py): one start-up line naming every op, and each op runs
where the plan put it, on our kernels or, planned without them, on torch's, transformers' float32
result either way."""

from __future__ import annotations

import logging

import pytest
import torch

from freetoken.kernels import grouped_gemm
from freetoken.kernels.plan import OPS, Available, plan_model
from freetoken.layers import attention, elementwise, norm, rotary
from freetoken.models.registry import load_model
from freetoken.scheduler.factory import build_scheduler
from tests.model_fixtures import assert_matches_reference, greedy_run, tiny_random_folder

PROMPT = [9707, 11, 1879, 0, 3555, 374, 279]


def _spy(monkeypatch) -> list[str]:
    """The kernels a step calls, by name, as the layers call them."""
    called: list[str] = []
    for module, name in ((norm, "rms_norm"), (norm, "add_rms_norm"), (rotary, "norm_rotate_kernel"),
                         (elementwise, "silu_mul")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: (called.append(_name), _real(*a))[1])
    real_pool = attention.Attention._on_pool
    monkeypatch.setattr(attention.Attention, "_on_pool",
                        lambda self, *a: (called.append("pool_attention"), real_pool(self, *a))[1])
    return called


@pytest.mark.skipif(grouped_gemm.load() is None, reason="the C kernels cannot be built or run here")
def test_each_op_runs_where_the_plan_put_it(caplog, monkeypatch):
    folder = tiny_random_folder("qwen3")
    with caplog.at_level(logging.INFO, logger="freetoken.kernels.plan"):
        loaded = load_model(folder, dtype="float32", device="cpu")
    lines = [r.getMessage() for r in caplog.records if "kernel plan" in r.getMessage()]
    assert len(lines) == 1 and all(f"{op}: " in lines[0] for op in OPS)
    plan = loaded.model.kernel_plan
    assert list(plan.stats) == list(OPS)
    assert plan.ops["norm"] == "grouped_gemm.c rms_norm_f32" and plan.ops["attention"] == "pool_attention.c (f32 pool)"
    assert plan.ops["moe_experts"] == "none" and plan.ops["sampler"].startswith("argmax: numpy")

    called = _spy(monkeypatch)
    on_kernels, _ = greedy_run(build_scheduler(loaded, kv_slots=64), {0: PROMPT}, steps=2)
    assert set(called) == {"rms_norm", "add_rms_norm", "norm_rotate_kernel", "silu_mul", "pool_attention"}
    assert_matches_reference(folder, PROMPT, on_kernels[0])

    # Planned where none of our kernels runs: the step calls none, and torch's ops give the result.
    bare = plan_model(loaded.model, plan, torch.float32, "cpu", Available(None, None, 0, None))
    assert all(bare.ops[op] in ("torch", "torch SDPA", "torch (lanewise)", "Python")
               for op in ("norm", "rotary", "swiglu", "attention", "layer"))
    called.clear()
    on_torch, _ = greedy_run(build_scheduler(loaded, kv_slots=64), {0: PROMPT}, steps=2)
    assert called == []
    assert_matches_reference(folder, PROMPT, on_torch[0])
