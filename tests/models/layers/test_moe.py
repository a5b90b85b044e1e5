"""The grouped expert executor: a token's result does not depend on its batch, and equals the
plain per-token sum of its experts' outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freetoken.models.kernels.grouped_gemm import load as load_kernel
from freetoken.models.layers.linear import pack_linears
from freetoken.models.layers import moe
from freetoken.models.layers.moe import Experts, silu_and_mul, softmax_topk, split_stacked_experts, stack_experts
from tests.model_fixtures import FLOAT32_KERNELS

E, H, I, K = 8, 48, 80, 2


def _experts(bias: bool) -> Experts:
    torch.manual_seed(1)
    experts = Experts(E, H, I, bias=bias, activation=silu_and_mul).requires_grad_(False)
    if bias:
        for expert in experts.experts:
            nn.init.normal_(expert.gate_up_proj.bias)
            nn.init.normal_(expert.down_proj.bias)
    return experts


def _route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(2))
    return softmax_topk(x @ router.T, K, normalize=True)


def _naive(experts: Experts, plain: list[tuple], x, ids, weights) -> torch.Tensor:
    """Token by token, expert by expert, on float64 copies of the weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(K):
            w1, b1, w2, b2 = plain[int(ids[t, j])]
            h = silu_and_mul(F.linear(x[t : t + 1].double(), w1, b1))
            out[t] += weights[t, j].double() * F.linear(h, w2, b2)[0]
    return out


@pytest.mark.parametrize("path", ["stacked", *FLOAT32_KERNELS])
@pytest.mark.parametrize("bias", [False, True])
def test_batched_is_alone_bit_for_bit_and_matches_a_per_token_sum(path, bias, monkeypatch, tmp_path):
    """On the grouped kernel stacked over experts, or each expert's Linears on one kernel
    (where the probe finds a row rule for it on this CPU)."""
    experts = _experts(bias)
    plain = [(e.gate_up_proj.weight.double().clone(),
              None if e.gate_up_proj.bias is None else e.gate_up_proj.bias.double().clone(),
              e.down_proj.weight.double().clone(),
              None if e.down_proj.bias is None else e.down_proj.bias.double().clone())
             for e in experts.experts]  # fmt: skip
    if path == "stacked":
        if (kernel := load_kernel()) is None:
            pytest.skip("the grouped kernel cannot be built or run here")
        experts.stack(kernel)
    else:
        monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
        monkeypatch.setenv("FREETOKEN_LINEAR_KERNEL", path)
        pack_linears(experts)
        plan = experts.kernel_plan
        if not plan.invariant or not all(v.startswith(path) for v in plan.kernels.values()):
            pytest.skip(f"{path}: not batch-invariant or cannot run on this CPU ({plan.kernels})")
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(3))
    weights, ids = _route(x)
    with torch.inference_mode():
        batched = experts(x, ids, weights)
        for t in range(x.shape[0]):
            alone = experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1])
            assert torch.equal(alone[0], batched[t]), t
        # A different company: the same token among others routed elsewhere.
        mixed = experts(x[[5, 0, 30, 5]], ids[[5, 0, 30, 5]], weights[[5, 0, 30, 5]])
    assert torch.equal(mixed[0], batched[5]) and torch.equal(mixed[3], batched[5])
    expected = _naive(experts, plain, x, ids, weights)
    assert (batched.double() - expected).abs().max().item() < 1e-5


def test_softmax_topk_follows_norm_topk_prob():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    weights, ids = softmax_topk(logits, 2, normalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]] and torch.allclose(weights, probs[:, [1, 2]])
    weights, _ = softmax_topk(logits, 2, normalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(1))


def test_split_stacked_experts_makes_per_expert_linears():
    gate_up = torch.randn(3, 6, 4)
    down = torch.randn(3, 4, 2)  # [E, in, out]: transposed layout
    state = {"m.experts.gate_up_proj": gate_up, "m.experts.down_proj": down,
             "m.experts.down_proj_bias": torch.randn(3, 2), "m.gate.weight": torch.randn(3, 4)}
    state = split_stacked_experts(state, "gate_up_proj")
    state = split_stacked_experts(state, "down_proj", transpose=True)
    assert torch.equal(state["m.experts.1.gate_up_proj.weight"], gate_up[1])
    assert torch.equal(state["m.experts.2.down_proj.weight"], down[2].T)
    assert state["m.experts.0.down_proj.bias"].shape == (2,)
    assert "m.gate.weight" in state and not any(k.endswith("experts.down_proj") for k in state)


@pytest.mark.skipif(load_kernel() is None, reason="the grouped kernel cannot be built or run here")
@pytest.mark.parametrize("alike", [True, False])
def test_experts_go_on_the_kernel_only_where_its_rows_come_out_alike(monkeypatch, alike):
    """The load-time check behind the kernel path, and its exact fallback: packed Linears."""
    if not alike:
        monkeypatch.setattr(moe, "rule_holds", lambda *args: False)
    experts = _experts(bias=True)
    stack_experts(experts)
    assert (experts.stacked is not None) == alike and (experts.experts is None) == alike
