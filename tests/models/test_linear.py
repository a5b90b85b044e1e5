"""Packed linear layers (oneDNN, else the grouped kernel, else F.linear): exact enough,
row-invariant, and no second copy of the weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freetoken.models import linear
from freetoken.models.grouped_gemm import load as load_kernel
from freetoken.models.linear import KERNEL_ROWS, MKL_ROWS, ONEDNN_ROWS, Linear, onednn_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu")),
                                reason="torch built without oneDNN")

# (in, out) of the default model's fused projections, its LM head, and a wider down projection.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152), (4864, 896)]


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_a_float64_matmul(bias):
    layer = Linear(576, 192, bias=bias).requires_grad_(False)
    weight = layer.weight.clone().double()
    bias_ref = layer.bias.clone().double() if bias else 0
    layer.pack()
    x = torch.randn(37, 576)
    expected = x.double() @ weight.T + bias_ref
    got = layer(x)
    assert got.dtype == torch.float32
    assert (got.double() - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_a_row_gets_the_same_bits_at_every_row_count_the_rule_allows(in_features, out_features):
    torch.manual_seed(in_features + out_features)
    layer = Linear(in_features, out_features, bias=False).requires_grad_(False)
    rule = pack_linears(layer)
    x = torch.randn(304, in_features)
    counts = [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 33, 64]
    if out_features < 10_000:
        counts += [127, 255, 300]
    with torch.inference_mode():
        reference = layer(x[: 1 + rule.pad(1)])[0]
        for n in counts:
            assert torch.equal(layer(x[: n + rule.pad(n)])[0], reference), n


def _tied_model() -> nn.Module:
    model = nn.Module()
    model.embed = nn.Embedding(100, 16)
    model.proj = Linear(16, 16, bias=False)
    model.head = Linear(16, 100, bias=False)
    model.head.weight = model.embed.weight
    return model.requires_grad_(False)


def test_packing_frees_plain_weights_but_keeps_a_tied_embedding():
    model = _tied_model()
    embedding = model.embed.weight.detach().clone()
    rule = pack_linears(model)
    x = torch.randn(4, 16)
    assert torch.allclose(model.head(x), x @ embedding.T, atol=1e-5)
    assert torch.equal(model.embed.weight, embedding)
    # A layer left on F.linear (the rows were not alike on this CPU) keeps its weight.
    assert model.proj.weight.numel() == (0 if rule is ONEDNN_ROWS else 16 * 16)


def test_layers_stay_on_f_linear_when_rows_are_not_alike(monkeypatch):
    monkeypatch.setattr(linear, "rows_alike", lambda layer, padding: False)
    model = _tied_model()
    proj = model.proj.weight.detach().clone()
    assert pack_linears(model) is MKL_ROWS
    assert model.proj.packed is None and model.head.packed is None
    x = torch.randn(4, 16)
    assert torch.equal(model.proj(x), F.linear(x, proj))


@pytest.mark.parametrize("rows,pad", [(1, 1), (2, 0), (3, 0), (7, 0)])
def test_onednn_rule_pads_only_a_single_row(rows, pad):
    assert ONEDNN_ROWS.pad(rows) == pad


@pytest.mark.parametrize("rows,pad", [(1, 3), (4, 0), (5, 3), (12, 0)])
def test_mkl_rule_pads_to_a_multiple_of_four(rows, pad):
    assert MKL_ROWS.pad(rows) == pad


def test_a_kernel_error_while_packing_leaves_f_linear(monkeypatch):
    def fail(layer, padding):
        raise RuntimeError("oneDNN cannot run this dtype here")

    monkeypatch.setattr(linear, "rows_alike", fail)
    model = _tied_model()
    assert pack_linears(model) is MKL_ROWS
    assert model.proj.packed is None and model.proj.weight.numel() == 16 * 16


@pytest.mark.skipif(load_kernel() is None, reason="the grouped kernel cannot be built or run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_run_on_the_grouped_kernel_where_onednn_cannot(monkeypatch, dtype):
    """As on a CPU whose oneDNN runs no bfloat16: any row count, float32 sums of the layer's own
    weights (checked in float64), a row's bits the same alone as among others."""
    monkeypatch.setattr(linear, "_pack_onednn", lambda layers: False)
    model = _tied_model().to(dtype)
    proj = model.proj.weight.detach().double()
    embedding = model.embed.weight.detach().clone()
    assert pack_linears(model) is KERNEL_ROWS
    assert model.proj.strips is not None and model.proj.weight.numel() == 0
    assert torch.equal(model.embed.weight, embedding)  # tied: kept for the embedding
    x = torch.randn(9, 16).to(dtype)
    with torch.inference_mode():
        out = model.proj(x)
        assert out.dtype == dtype
        expected = (x.double() @ proj.T).to(dtype).double()
        assert (out.double() - expected).abs().max().item() <= (0.02 if dtype == torch.bfloat16 else 1e-5)
        for r in range(9):
            assert torch.equal(model.proj(x[r : r + 1])[0], out[r]), r
