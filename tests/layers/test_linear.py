"""Linear layers on the kernel the probe chose: exact, batch-invariant as chosen on this CPU
(whatever it is), and no second copy of the weights."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from freetoken.layers import kernel_choice, linear
from freetoken.kernels.grouped_gemm import grouped_gemm
from freetoken.layers.kernel_choice import RULES, UNCAPPED, Measured, RowRule, plans, rule_seconds
from freetoken.layers.linear import Linear, choose, only_kernel, pack_linears, prepare
from tests.model_fixtures import FLOAT32_KERNELS, KERNEL_DTYPES

# (in, out) of the default model's fused projections, its LM head, and a wider down projection.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152), (4864, 896)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _own_probe_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))


def _layer(in_features: int, out_features: int, dtype=torch.float32, bias=False) -> Linear:
    torch.manual_seed(in_features + out_features)
    layer = Linear(in_features, out_features, bias=bias).to(dtype).requires_grad_(False)
    if bias:
        nn.init.normal_(layer.bias)
    return layer


def _on(kernel: str, layer: Linear, monkeypatch) -> None:
    """`layer` packed on `kernel` alone; skips where that kernel cannot run or keeps no row rule
    on this CPU (the probe decides, on this machine, never a list of CPUs)."""
    if prepare(kernel, layer) is None:
        pytest.skip(f"{kernel} cannot run {layer.weight.dtype} here")
    with only_kernel(kernel):
        pack_linears(layer)
    if not layer.kernel_plan.invariant:
        pytest.skip(f"{kernel}: no row rule holds for {layer.weight.dtype} "
                    f"{layer.in_features}x{layer.out_features} on this CPU")


@pytest.mark.parametrize("kernel,dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_each_kernel_matches_a_float64_matmul(kernel, dtype, bias):
    layer = _layer(576, 192, dtype, bias)
    run = prepare(kernel, layer)
    if run is None:
        pytest.skip(f"{kernel} cannot run {dtype} here")
    weight = layer.weight.double()
    bias_ref = layer.bias.double() if bias else 0
    x = torch.randn(37, 576).to(dtype)
    with torch.inference_mode():
        got = run(x)
    assert got.dtype == dtype
    expected = x.double() @ weight.T + bias_ref
    # bfloat16: the output's own rounding (8 bits), on values of size ~sqrt(576).
    assert (got.double() - expected).abs().max().item() < (0.25 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("kernel,dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_outputs_at_some_columns_keep_the_whole_layers_bits(kernel, dtype, bias, monkeypatch):
    """`logits_at` (an LM head whose rows' masks allow a few ids): those columns alone, as the
    whole layer computes them, on our kernels; None on a library's (no promise that a column's
    sum does not depend on the columns beside it)."""
    layer = _layer(576, 1000, dtype, bias)
    _on(kernel, layer, monkeypatch)
    x = torch.randn(5, 576).to(dtype)
    columns = [0, 15, 16, 31, 32, 500, 999]  # strip edges, the last strip partial
    with torch.inference_mode():
        got = layer.logits_at(x, columns)
        if kernel not in linear.INVARIANT_BY_CONSTRUCTION:
            assert got is None
            return
        expected = layer(x).float()[:, columns]
        assert torch.equal(got, expected)
        assert torch.equal(layer.logits_at(x[:1], columns), expected[:1])  # again, cached, one row


@pytest.fixture(scope="module")
def shared_probe_cache():
    """The suite's probe cache (set up before the autouse one replaces it): each shape's
    candidates probed once, the LM head's (a minute on an AVX2 machine) shared with the loads of
    the default model dequantized elsewhere in the suite; the check below is the test's own."""
    from freetoken.paths import cache_root

    return cache_root()


# The LM head's shape (576x49152) with the kernel the probe chose only: forcing each other
# kernel on it too cost ~100 s of CI's CPU, and those kernels' rows are checked on every
# projection shape.
ROW_COUNT_CASES = [(kernel, dtype, shape) for shape in SHAPES
                   for kernel, dtype in [*(("auto", d) for d in DTYPES), *KERNEL_DTYPES]
                   if kernel == "auto" or shape[1] < 10_000]


@pytest.mark.parametrize("kernel,dtype,shape", ROW_COUNT_CASES)
def test_a_row_gets_the_same_bits_at_every_row_count(kernel, dtype, shape, monkeypatch, shared_probe_cache):
    """Row counts the probe did not try (6, 10, 300, 511: past `most`, split into calls), rows in
    the middle of their call, against the row computed alone (the layer pads a call below its
    rule's minimum itself)."""
    monkeypatch.setenv("FREETOKEN_CACHE", str(shared_probe_cache))
    in_features, out_features = shape
    layer = _layer(in_features, out_features, dtype)
    if kernel == "auto":
        pack_linears(layer)
        if not layer.kernel_plan.invariant:
            pytest.skip(f"no kernel's rows come out alike on {dtype} {in_features}x{out_features} here")
    else:
        _on(kernel, layer, monkeypatch)
    x = torch.randn(530, in_features).to(dtype)
    counts = [1, 2, 3, 6, 10, 16, 33, 64] + ([300, 511] if out_features < 10_000 else [])
    with torch.inference_mode():
        alone = {r: layer(x[r : r + 1])[0] for r in (0, 1, 5, 299, 510)}
        for n in counts:
            out = layer(x[:n])
            for r, expected in alone.items():
                if r < n:
                    assert torch.equal(out[r], expected), (n, r)


@pytest.mark.parametrize("rows", range(1, 70))
@pytest.mark.parametrize("rule", [RowRule(1, 32), RowRule(2, 32), RowRule(16, 32), RowRule(16, 256)])
def test_calls_are_each_allowed_and_cover_the_rows(rule, rows):
    if rows < rule.minimum:
        assert rule.pad(rows) == rule.minimum - rows
        return
    assert rule.pad(rows) == 0
    sizes = rule.calls(rows)
    assert sum(sizes) == rows and all(rule.minimum <= s <= rule.most for s in sizes)


def test_rules_are_costed_by_the_calls_they_make():
    # A kernel whose call costs a fixed overhead plus a time per row, as a GEMM on packed
    # weights does: splitting 256 rows into calls of 32 pays the overhead 8 times.
    timings = {plan: sum(50e-6 + n * 1e-6 for n in plan) for rule in RULES for plan in plans(rule)}
    costs = {rule: rule_seconds(timings, rule) for rule in RULES}
    assert min(costs, key=costs.get) == RowRule(1, 256)
    assert costs[RowRule(1, 32)] > costs[RowRule(1, 256)] * 1.2
    assert costs[RowRule(64, 256)] > costs[RowRule(1, 256)]  # a 1-row call padded to 64


def _fake_measure(results: dict[str, tuple[RowRule | None, float]]):
    def measure(runs, in_features, dtype, device):
        return [Measured(kernel, *results[kernel]) for kernel in runs]
    return measure


@pytest.mark.parametrize("results,kernel,invariant", [
    # The fastest kernel whose rows come out alike wins, however fast one that is not.
    ({"onednn": (RowRule(1, 32), 2.0), "torch": (None, 1.0), "grouped": (RowRule(), 3.0)}, "onednn", True),
    ({"onednn": (None, 2.0), "torch": (RowRule(16), 5.0), "grouped": (RowRule(), 3.0)}, "grouped", True),
    # Ours wins a tie (within RULE_TIE): no row cap, no padding of a decode step's row.
    ({"onednn": (RowRule(16), 1.0), "torch": (RowRule(16), 2.0), "grouped": (RowRule(2), 1.04)}, "grouped", True),
    ({"onednn": (RowRule(16), 1.0), "torch": (RowRule(16), 2.0), "grouped": (RowRule(2), 1.06)}, "onednn", True),
    # None is: the fastest runs, and the plan says so.
    ({"onednn": (None, 2.0), "torch": (None, 1.0), "grouped": (None, 3.0)}, "torch", False),
])
def test_choice_takes_the_fastest_invariant_kernel(results, kernel, invariant, monkeypatch):
    """As on a CPU with other kernels' properties than this one's: the probe and timings faked."""
    if any(prepare(name, _layer(16, 16)) is None for name in FLOAT32_KERNELS):
        pytest.skip("not every float32 kernel runs here")
    monkeypatch.setattr(linear, "CANDIDATES", FLOAT32_KERNELS)
    monkeypatch.setattr(linear, "measure", _fake_measure(results))
    model = _tied_model()
    plan = pack_linears(model)
    functions = {"onednn": linear._onednn, "torch": linear._f_linear, "grouped": grouped_gemm}
    assert model.proj.run.func is functions[kernel]
    assert plan is model.kernel_plan and plan.invariant is invariant
    # Our grouped kernel is invariant by construction: once probed so, its calls take any rows.
    assert model.proj.rule == (RowRule(1, UNCAPPED) if kernel == "grouped" else results[kernel][0] or RowRule())
    assert any(kernel in v for v in plan.kernels.values())


def _onednn_fastest(monkeypatch) -> nn.Module:
    """A module with a 16x16 `proj`, the float32 kernels' probes faked: oneDNN fastest, ours
    three times slower."""
    if any(prepare(name, _layer(16, 16)) is None for name in FLOAT32_KERNELS):
        pytest.skip("not every float32 kernel runs here")
    monkeypatch.setattr(linear, "CANDIDATES", FLOAT32_KERNELS)
    monkeypatch.setattr(linear, "measure", _fake_measure(
        {"onednn": (RowRule(1, 32), 1.0), "torch": (RowRule(16), 2.0), "grouped": (RowRule(), 3.0)}))
    model = nn.Module()
    model.proj = Linear(16, 16, bias=False)
    return model


@pytest.mark.parametrize("wanted", [False, True])
def test_a_head_for_columns_goes_to_a_kernel_that_computes_columns_alone(wanted, monkeypatch):
    """A pooling server's LM head (--runner pooling) on our kernel though oneDNN times faster:
    `logits_at` then computes a reranker's two columns, not the vocabulary; the other layers and
    a generation server's head keep the fastest."""
    model = _onednn_fastest(monkeypatch)
    model.lm_head = Linear(16, 100, bias=False)
    model.requires_grad_(False)
    x = torch.randn(3, 16)
    whole = model.lm_head(x)
    with linear.head_for_columns(wanted):
        pack_linears(model)
    assert model.proj.run.func is linear._onednn
    assert model.lm_head.run.func is (grouped_gemm if wanted else linear._onednn)
    columns = model.lm_head.logits_at(x, [3, 70])
    if not wanted:
        assert columns is None
        return
    assert torch.equal(columns, model.lm_head(x)[:, [3, 70]])
    assert torch.allclose(columns, whole[:, [3, 70]], atol=1e-5, rtol=0)


def test_a_layer_that_wants_ours_goes_to_ours_though_onednn_is_faster(monkeypatch):
    """An MoE router (run inside decoder_layer.c's sparse layer, which calls our kernels alone) on
    ours at three times oneDNN's faked time; a layer beside it without the flag keeps oneDNN."""
    model = _onednn_fastest(monkeypatch)
    model.router = Linear(16, 8, bias=False)
    model.router.wants_ours = True
    model.requires_grad_(False)
    pack_linears(model)
    assert model.proj.run.func is linear._onednn
    assert model.router.run.func is grouped_gemm and model.router.rule == RowRule(1, UNCAPPED)


def test_probes_are_kept_per_machine_and_reused(monkeypatch):
    calls = []

    def measure(runs, in_features, dtype, device):
        calls.append(list(runs))
        return [Measured(kernel, RowRule(), 1.0) for kernel in runs]

    monkeypatch.setattr(linear, "measure", measure)
    built = []
    monkeypatch.setattr(linear, "_probe_layer", lambda layer: built.append(layer) or layer)
    choose(_layer(16, 24))
    first = len(calls)
    assert first >= 1 and len(built) == 1
    choose(_layer(16, 24))
    # Read from the cache folder, without building a probe layer (the LM head's size) again.
    assert len(calls) == first and len(built) == 1
    # A cap changes the kernels: probed anew.
    other = "SSE41" if os.environ.get("ONEDNN_MAX_CPU_ISA") != "SSE41" else "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", other)
    choose(_layer(16, 24))
    assert len(calls) == 2 * first


def _tied_model(dtype=torch.float32) -> nn.Module:
    model = nn.Module()
    model.embed = nn.Embedding(100, 16)
    model.proj = Linear(16, 16, bias=False)
    model.head = Linear(16, 100, bias=False)
    model.head.weight = model.embed.weight
    return model.requires_grad_(False).to(dtype)


@pytest.mark.parametrize("kernel", FLOAT32_KERNELS)
def test_packing_frees_plain_weights_but_keeps_a_tied_embedding(kernel, monkeypatch):
    model = _tied_model()
    if prepare(kernel, model.proj) is None:
        pytest.skip(f"{kernel} cannot run here")
    embedding = model.embed.weight.detach().clone()
    proj = model.proj.weight.detach().double().clone()
    with only_kernel(kernel):
        pack_linears(model)
    x = torch.randn(4, 16)
    with torch.inference_mode():
        assert torch.allclose(model.head(x), x @ embedding.T, atol=1e-5)
        assert torch.allclose(model.proj(x).double(), x.double() @ proj.T, atol=1e-5)
    assert torch.equal(model.embed.weight, embedding)
    # F.linear reads the plain weight; the other kernels keep their own copy of it.
    assert model.proj.weight.numel() == (16 * 16 if kernel == "torch" else 0)


def test_a_shape_no_candidate_runs_is_reported_not_invariant(monkeypatch):
    """A forced kernel that cannot run the dtype leaves the layers on F.linear, unprobed: the
    plan must not claim invariance for them."""
    monkeypatch.setattr(linear, "prepare", lambda kernel, layer: None)
    model = _tied_model()
    plan = pack_linears(model)
    assert not plan.invariant and set(plan.kernels.values()) == {"F.linear (not probed)"}
    x = torch.randn(3, 16)
    assert torch.equal(model.proj(x), torch.nn.functional.linear(x, model.proj.weight))


@pytest.mark.parametrize("timings,widest", [
    # Within RULE_TIE (5 %) of the fastest: noise on a loaded machine; the widest rule wins.
    ({RowRule(1, 256): 1.03, RowRule(16, 256): 1.0, RowRule(1, 32): 0.99}, RowRule(1, 256)),
    ({RowRule(1, 256): 1.2, RowRule(16, 256): 1.0, RowRule(1, 32): 0.99}, RowRule(16, 256)),
    # Faster past the noise: the narrower rule is kept.
    ({RowRule(1, 256): 1.0, RowRule(16, 256): 1.0, RowRule(1, 32): 0.5}, RowRule(1, 32)),
])
def test_rules_timed_within_noise_go_to_the_widest(timings, widest, monkeypatch):
    monkeypatch.setattr(kernel_choice, "rules_holding",
                        lambda run, k, dtype, rules, device: [rule for rule in rules if rule in timings])
    monkeypatch.setattr(kernel_choice, "plan_seconds", lambda runs, timed, k, dtype, device: {})
    monkeypatch.setattr(kernel_choice, "rule_seconds", lambda own, rule: timings[rule])
    [chosen] = kernel_choice.measure({"fake": None}, 16, torch.float32, "cpu")
    assert chosen.rule == widest
