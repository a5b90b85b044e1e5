"""The grouped expert executor: a token's result does not depend on its batch, and equals the
plain per-token sum of its experts' outputs; experts kept quantized equal the float path on
their dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants
from torch import nn

from freetoken.kernels.grouped_gemm import load as load_kernel
from freetoken.kernels.plan import available
from freetoken.kernels.quant import QuantizedWeight
from freetoken.layers.linear import only_kernel, pack_linears
from freetoken.layers import moe
from freetoken.layers.moe import Experts, silu_and_mul, softmax_topk, split_stacked_experts, stack_experts
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
        with only_kernel(path):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sum_on", ["planned", "torch"])
def test_a_tokens_experts_are_summed_in_float32_in_ascending_expert_id(dtype, sum_on):
    """Each expert's output alone (weight 1), then per token a float32 sum from zero over its
    experts in ascending id of weight x output (the product in the rows' dtype), rounded once:
    the layer's result, bit for bit, at 1 token and among 37; the sum as planned here
    (grouped_gemm.c's moe_sum_f32 for float32 rows) and on torch's ops."""
    if (kernel := load_kernel()) is None:
        pytest.skip("the grouped kernel cannot be built or run here")
    experts = _experts(bias=False)
    experts.stack(kernel)
    planned = experts.plan_kernels(available(), dtype, "cpu")
    assert planned["moe_sum"] == ("grouped_gemm.c moe_sum_f32" if dtype == torch.float32 else "torch")
    if sum_on == "torch":
        experts.sum_kernel = None
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(4)).to(dtype)
    weights, ids = _route(x.float())
    one = torch.ones(1, 1)
    with torch.inference_mode():
        for rows in (slice(0, 1), slice(None)):
            got = experts(x[rows], ids[rows], weights[rows])
            for t in range(got.shape[0]):
                acc = torch.zeros(H, dtype=torch.float32)
                for j in sorted(range(K), key=lambda j: int(ids[rows][t, j])):
                    alone = experts(x[rows][t : t + 1], ids[rows][t : t + 1, j : j + 1], one)[0]
                    acc += weights[rows][t, j].to(dtype) * alone
                assert torch.equal(got[t], acc.to(dtype)), (rows, t)


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


# ---------------------------------------------------------------- experts kept quantized

QE, QH, QI = 4, 256, 256  # K-quant blocks are 256 wide along K (H for gate/up, I for down)


def _random_blocks(qtype: GGMLQuantizationType, rows: int, k: int, seed: int) -> np.ndarray:
    """[rows, row bytes] of valid `qtype` blocks: random bytes, the float fields set to small
    finite scales (gguf's numpy code has no K-quant quantizer, and random blocks cover every
    code and sub-block scale)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    # Scales that keep the weights within about 0.1 (K-quants multiply d by 6-bit sub-scales).
    top = {GGMLQuantizationType.Q8_0: 1e-3, GGMLQuantizationType.Q4_0: 1e-2, GGMLQuantizationType.Q4_1: 1e-2}

    def scales(n: int) -> np.ndarray:
        values = rng.uniform(0.2, 1.0, (rows, k // block, n)) * top.get(qtype, 1e-4)
        return values.astype(np.float16).view(np.uint8)

    if qtype == GGMLQuantizationType.MXFP4:
        data[..., 0] = rng.integers(118, 122, (rows, k // block))  # E8M0 exponents near 2**-7
    elif qtype == GGMLQuantizationType.Q6_K:
        data[..., -2:] = scales(1)  # d last
    elif qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q4_1):
        data[..., :4] = scales(2)  # d, then dmin (Q4_1: m)
    else:
        data[..., :2] = scales(1)
    return data.reshape(rows, -1)


def _random_quantized(qtype: GGMLQuantizationType, e: int, n: int, k: int, seed: int) -> QuantizedWeight:
    data = np.stack([_random_blocks(qtype, n, k, seed * 100 + i) for i in range(e)])
    return QuantizedWeight(qtype, torch.from_numpy(data), (e, n, k))


def _float_weights(weight: QuantizedWeight) -> torch.Tensor:
    """gguf's own numpy dequantizer, the reference."""
    return torch.from_numpy(gguf_quants.dequantize(weight.data.numpy(), weight.qtype)).reshape(weight.shape)


def _quantized_and_float(qtype: GGMLQuantizationType, bias: bool,
                         down_qtype: GGMLQuantizationType | None = None) -> tuple[Experts, Experts]:
    """The same experts as `use_quantized` runs them and as float Linears on their dequantized
    weights (the plain torch path); down in `down_qtype` if given (GGUF's Q4_K_M files keep
    some ffn_down_exps in Q6_K)."""
    quantized = Experts(QE, QH, QI, bias=bias, activation=silu_and_mul).requires_grad_(False)
    plain = Experts(QE, QH, QI, bias=bias, activation=silu_and_mul).requires_grad_(False)
    gate_up = _random_quantized(qtype, QE, 2 * QI, QH, 1)
    down = _random_quantized(down_qtype or qtype, QE, QH, QI, 2)
    generator = torch.Generator().manual_seed(4)
    biases = [torch.randn(QE, n, generator=generator) * 0.1 if bias else None for n in (2 * QI, QH)]
    for name, weight, b in (("gate_up_proj", gate_up, biases[0]), ("down_proj", down, biases[1])):
        for e, expert in enumerate(plain.experts):
            getattr(expert, name).weight.copy_(_float_weights(weight)[e])
            if b is not None:
                getattr(expert, name).bias.copy_(b[e])
    quantized.use_quantized(gate_up, down, *biases)
    return quantized, plain


QTYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K,
          GGMLQuantizationType.MXFP4]


def _routed_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(13, QH, generator=torch.Generator().manual_seed(3))
    router = torch.randn(QE, QH, generator=torch.Generator().manual_seed(2))
    return x, *softmax_topk(x @ router.T, K, normalize=True)


@pytest.mark.parametrize(("qtype", "down_qtype"), [*((q, None) for q in QTYPES),
                                                   (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)],
                         ids=lambda q: getattr(q, "name", "same"))
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_experts_match_the_float_path_on_their_dequantized_weights(qtype, down_qtype, bias):
    quantized, plain = _quantized_and_float(qtype, bias, down_qtype)
    assert quantized.experts is None and quantized.quantized is not None
    x, weights, ids = _routed_rows()
    with torch.inference_mode():
        got, expected = quantized(x, ids, weights), plain(x, ids, weights)
        bf16 = quantized(x.bfloat16(), ids, weights)
    assert expected.abs().max() > 0.1 and (got - expected).abs().max().item() < 1e-5
    scale = expected.abs().max()
    assert bf16.dtype == torch.bfloat16 and (bf16.float() - expected).abs().max() < 0.05 * scale


# bfloat16 rows are widened before the kernel whatever the format.
@pytest.mark.parametrize(("qtype", "dtype"), [*((q, torch.float32) for q in QTYPES),
                                              (GGMLQuantizationType.Q4_K, torch.bfloat16)],
                         ids=lambda v: getattr(v, "name", str(v).removeprefix("torch.")))
def test_quantized_experts_batched_is_alone_bit_for_bit(qtype, dtype):
    quantized, _ = _quantized_and_float(qtype, bias=True)
    x, weights, ids = _routed_rows()
    x = x.to(dtype)
    with torch.inference_mode():
        batched = quantized(x, ids, weights)
        for t in range(x.shape[0]):
            assert torch.equal(quantized(x[t : t + 1], ids[t : t + 1], weights[t : t + 1])[0], batched[t]), t
        mixed = quantized(x[[5, 0, 12, 5]], ids[[5, 0, 12, 5]], weights[[5, 0, 12, 5]])
    assert torch.equal(mixed[0], batched[5]) and torch.equal(mixed[3], batched[5])


def test_gate_and_up_as_parts_are_one_weight_of_their_rows():
    """A GGUF file's ffn_gate_exps and ffn_up_exps held apart, each in its own format: the bits
    of float Linears on the dequantized rows' sums, and of one weight when the formats agree."""
    gate = _random_quantized(GGMLQuantizationType.Q4_K, QE, QI, QH, 5)
    up = _random_quantized(GGMLQuantizationType.Q8_0, QE, QI, QH, 6)
    down = _random_quantized(GGMLQuantizationType.Q6_K, QE, QH, QI, 7)
    parts = Experts(QE, QH, QI, bias=False, activation=silu_and_mul).requires_grad_(False)
    parts.use_quantized((gate, up), down)
    assert parts.quantized.nbytes == gate.nbytes + up.nbytes + down.nbytes
    plain = Experts(QE, QH, QI, bias=False, activation=silu_and_mul).requires_grad_(False)
    gate_up = torch.cat([_float_weights(gate), _float_weights(up)], dim=1)
    for e, expert in enumerate(plain.experts):
        expert.gate_up_proj.weight.copy_(gate_up[e])
        expert.down_proj.weight.copy_(_float_weights(down)[e])
    same = _random_quantized(GGMLQuantizationType.Q4_K, QE, QI, QH, 8)
    split, whole = (Experts(QE, QH, QI, bias=False, activation=silu_and_mul) for _ in range(2))
    split.use_quantized((gate, same), down)
    whole.use_quantized(QuantizedWeight(gate.qtype, torch.cat([gate.data, same.data], dim=1), (QE, 2 * QI, QH)),
                        down)
    x, weights, ids = _routed_rows()
    with torch.inference_mode():
        got, expected = parts(x, ids, weights), plain(x, ids, weights)
        assert torch.equal(split(x, ids, weights), whole(x, ids, weights))
    assert expected.abs().max() > 0.1 and (got - expected).abs().max().item() < 1e-5


def test_use_quantized_refuses_weights_of_another_shape():
    experts = Experts(QE, QH, QI, bias=False, activation=silu_and_mul)
    down = _random_quantized(GGMLQuantizationType.Q8_0, QE, QH, QI, 2)
    with pytest.raises(ValueError, match=r"gate_up weight is \(4, 256, 256\).*\(4, 512, 256\)"):
        experts.use_quantized(_random_quantized(GGMLQuantizationType.Q8_0, QE, QI, QH, 1), down)


def test_experts_without_a_kernel_here_are_dequantized_at_load_with_a_log_line(monkeypatch, caplog):
    quantized, plain = _quantized_and_float(GGMLQuantizationType.Q4_K, bias=True)
    holder = nn.Sequential(quantized)
    moe.widen_unsupported_experts(holder, torch.float32, torch.device("cpu"))
    assert quantized.quantized is not None  # the stub's formats all run here
    monkeypatch.setattr(moe, "supported", lambda qtype: qtype != GGMLQuantizationType.Q4_K)
    with caplog.at_level("INFO", logger=moe.__name__):
        moe.widen_unsupported_experts(holder, torch.float32, torch.device("cpu"))
    assert quantized.quantized is None and "Q4_K experts dequantized to float32" in caplog.text
    for mine, theirs in zip(quantized.experts, plain.experts):
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(mine, name).weight, getattr(theirs, name).weight)
            assert torch.equal(getattr(mine, name).bias, getattr(theirs, name).bias)
