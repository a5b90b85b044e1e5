"""The grouped expert kernel (kernels/csrc/grouped_gemm.c) against float64 matmuls computed by
torch, and the property the experts rely on: a row's bits depend neither on its group, nor on the
other groups, nor on the thread count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken.kernels import grouped_gemm as gg
from freetoken.kernels.build import build
from freetoken.layers import kernel_choice

KERNEL = gg.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the grouped kernel cannot be built or run here")

E, K, N = 5, 37, 53  # N not a multiple of the 16-column strip, K odd


def _experts(bias: bool, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(N, K, generator=gen).to(dtype) for _ in range(E)]
    biases = [torch.randn(N, generator=gen) if bias else None for _ in range(E)]
    return weights, biases


def _groups(counts: list[tuple[int, int]]) -> torch.Tensor:
    """(expert, rows) runs -> [G, 3] (expert, first row, rows)."""
    groups, first = [], 0
    for expert, rows in counts:
        groups.append((expert, first, rows))
        first += rows
    return torch.tensor(groups, dtype=torch.int64)


def test_pack_lays_out_strips_of_sixteen_columns():
    weights, biases = _experts(bias=True)
    packed = gg.pack(weights, biases)
    assert packed.weight.shape == (E, 4, K, 16) and packed.bias.shape == (E, 64)
    for e in range(E):
        strips = packed.weight[e].transpose(0, 1).reshape(K, -1)
        assert torch.equal(strips[:, :N].T, weights[e]) and not strips[:, N:].any()
        assert torch.equal(packed.bias[e, :N], biases[e]) and not packed.bias[e, N:].any()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_matmuls(bias, dtype):
    """bfloat16 weights are widened exactly and summed in float32: the rows (float32 here) get
    float32 accuracy against the same bfloat16 weights in float64."""
    weights, biases = _experts(bias, dtype)
    counts = [(0, 1), (2, 13), (3, 4), (4, 7), (1, 2)]
    groups = _groups(counts)
    x = torch.randn(sum(n for _, n in counts), K, generator=torch.Generator().manual_seed(1))
    y = gg.grouped_gemm(KERNEL, x, gg.pack(weights, biases), groups)
    for expert, first, rows in groups.tolist():
        part = x[first : first + rows].double()
        expected = part @ weights[expert].double().T
        if bias:
            expected += biases[expert].double()
        assert (y[first : first + rows].double() - expected).abs().max().item() < 1e-5


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_its_group_or_the_thread_count(dtype):
    weights, biases = _experts(bias=True, dtype=dtype)
    packed = gg.pack(weights, biases)
    counts = [(0, 3), (1, 9), (4, 6), (2, 1)]
    groups = _groups(counts)
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(2)).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gg.grouped_gemm(KERNEL, x, packed, groups)
        torch.set_num_threads(2)
        two = gg.grouped_gemm(KERNEL, x, packed, groups)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for expert, first, rows in groups.tolist():
        for r in range(first, first + rows):
            alone = gg.grouped_gemm(KERNEL, x[r : r + 1], packed, _groups([(expert, 1)]))
            assert torch.equal(alone[0], one[r]), r
        # The same rows as one group of another size, after an unrelated group.
        shifted = torch.cat([x[:2], x[first : first + rows]])
        again = gg.grouped_gemm(KERNEL, shifted, packed, _groups([(3, 2), (expert, rows)]))
        assert torch.equal(again[2:], one[first : first + rows])


def test_without_a_compiler_the_build_fails_cleanly(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(FileNotFoundError):
        build(gg.SOURCE)


def test_a_failing_compiler_is_an_os_error_that_load_reports(monkeypatch):
    monkeypatch.setenv("CC", "false")  # exits 1, as a compiler that rejects the source
    with pytest.raises(OSError, match="failed"):
        build(gg.SOURCE)


def test_freetoken_no_kernels_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("FREETOKEN_NO_KERNELS", "1")
    gg.load.cache_clear()
    try:
        assert gg.load() is None
    finally:
        monkeypatch.delenv("FREETOKEN_NO_KERNELS")
        gg.load.cache_clear()


def test_the_source_ships_as_package_data_and_keys_the_probe_cache(tmp_path, monkeypatch):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    root = Path(__file__).resolve().parents[2]
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p for glob in package_data["freetoken"] for p in (root / "python" / "freetoken").glob(glob)}
    assert all(source.is_file() and source in shipped for source in kernel_choice.OUR_KERNELS)
    # A change to a source is a new probe-cache key (its probes said nothing of the new code).
    key = kernel_choice._machine()
    for i, source in enumerate(kernel_choice.OUR_KERNELS):
        edited = tmp_path / source.name
        edited.write_bytes(source.read_bytes() + b"\n")
        sources = list(kernel_choice.OUR_KERNELS)
        sources[i] = edited
        monkeypatch.setattr(kernel_choice, "OUR_KERNELS", tuple(sources))
        kernel_choice._our_kernels.cache_clear()
        try:
            assert kernel_choice._machine() != key
        finally:
            monkeypatch.undo()
            kernel_choice._our_kernels.cache_clear()
    assert kernel_choice._machine() == key


@needs_kernel
@pytest.mark.parametrize("mode", ["ROUTE_SOFTMAX_TOPK", "ROUTE_SOFTMAX_TOPK_NORM", "ROUTE_TOPK_SOFTMAX"])
def test_moe_route_against_float64_and_a_rows_route_its_own(mode):
    """moe_route_f32 against a float64 route computed apart (Qwen-MoE's softmax then top k,
    renormalised or not; gpt-oss's top k then softmax): the same experts in descending order,
    weights within 1e-6, at 128 experts and at 60 (not a multiple of the exp's 8 lanes); a tie
    goes to the lower id; each row's route the same alone and among 100 (the kernel splits rows
    over threads from 64)."""
    gen = torch.Generator().manual_seed(7)
    for experts in (128, 60):
        logits = torch.randn(100, experts, generator=gen) * 3
        logits[5, 9] = logits[5, 40] = logits[5].max() + 1  # a tie at the top
        weights, ids = gg.moe_route(KERNEL, logits, 8, gg.ROUTES[mode])
        probs = torch.softmax(logits.double(), dim=-1)
        top, expected = torch.sort(probs, dim=-1, descending=True, stable=True)
        top = top[:, :8]
        if mode == "ROUTE_TOPK_SOFTMAX":
            top = torch.softmax(logits.double().gather(1, expected[:, :8]), dim=-1)
        elif mode == "ROUTE_SOFTMAX_TOPK_NORM":
            top = top / top.sum(-1, keepdim=True)
        assert torch.equal(ids, expected[:, :8]) and ids[5, :2].tolist() == [9, 40]
        assert (weights.double() - top).abs().max().item() < 1e-6
        for t in (0, 5, 99):
            alone = gg.moe_route(KERNEL, logits[t : t + 1], 8, gg.ROUTES[mode])
            assert torch.equal(alone[0], weights[t : t + 1]) and torch.equal(alone[1], ids[t : t + 1])
    with pytest.raises(ValueError, match="top 9 of 8"):
        gg.moe_route(KERNEL, torch.zeros(1, 8), 9, gg.ROUTES[mode])


@needs_kernel
def test_clamped_swiglu_against_float64_and_a_rows_bits_its_own():
    """gpt-oss's activation, clamped_swiglu_f32, against the formula in float64 (values beyond
    the limit both ways, so both clamps act): within 1e-6 relative; a NaN kept; a row's bits the
    same alone and among 300 (split over threads)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 2 * 40, generator=gen) * 6
    x[7, 3] = float("nan")
    y = gg.clamped_swiglu(KERNEL, x, 1.702, 7.0)
    gate, up = x[:, :40].double().clamp(max=7.0), x[:, 40:].double().clamp(-7.0, 7.0)
    expected = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    assert torch.isnan(y[7, 3]) and torch.allclose(y.double(), expected, rtol=1e-6, atol=1e-6, equal_nan=True)
    for r in (0, 7, 299):
        alone = gg.clamped_swiglu(KERNEL, x[r : r + 1], 1.702, 7.0)
        assert torch.equal(alone.view(torch.int32), y[r : r + 1].view(torch.int32))  # bits, NaN too
