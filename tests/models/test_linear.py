"""Packed oneDNN linear layers: exact enough, row-invariant, and no second copy of the weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from freetoken.engine.engine import MIN_ROWS
from freetoken.models.linear import Linear, onednn_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu")),
                                reason="torch built without oneDNN")

# (in, out) of the default model's projections, its LM head, and a wider down projection.
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152), (4864, 896)]


def _packed(in_features: int, out_features: int, bias: bool) -> Linear:
    torch.manual_seed(in_features + out_features)
    layer = Linear(in_features, out_features, bias=bias).requires_grad_(False)
    pack_linears(layer)
    assert layer.packed is not None
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_a_float64_matmul(bias):
    layer = Linear(576, 192, bias=bias).requires_grad_(False)
    weight = layer.weight.clone().double()
    bias_ref = layer.bias.clone().double() if bias else 0
    pack_linears(layer)
    x = torch.randn(37, 576)
    expected = x.double() @ weight.T + bias_ref
    got = layer(x)
    assert got.dtype == torch.float32
    assert (got.double() - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_a_row_gets_the_same_bits_among_any_number_of_rows(in_features, out_features):
    layer = _packed(in_features, out_features, bias=False)
    x = torch.randn(300, in_features)
    with torch.inference_mode():
        reference = layer(x[:MIN_ROWS])[0]
        sizes = [MIN_ROWS, 3, 4, 5, 7, 8, 13, 16, 31, 32, 33, 64]
        if out_features < 10_000:
            sizes += [127, 255, 300]
        for m in sizes:
            assert torch.equal(layer(x[:m])[0], reference), m


def test_packing_frees_plain_weights_but_keeps_a_tied_embedding():
    model = nn.Module()
    model.embed = nn.Embedding(100, 16)
    model.proj = Linear(16, 16, bias=False)
    model.head = Linear(16, 100, bias=False)
    model.head.weight = model.embed.weight
    embedding = model.embed.weight.detach().clone()
    model.requires_grad_(False)
    pack_linears(model)
    assert model.proj.weight.numel() == 0
    assert torch.equal(model.embed.weight, embedding)
    x = torch.randn(4, 16)
    assert torch.allclose(model.head(x), x @ embedding.T, atol=1e-5)
