"""One process's layers in tensor-parallel parts: each part has the shape a rank of 2 holds (so
the load-time probe gives it the same kernel), and the parts together compute the layer."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from freetoken.layers.kernel_choice import Measured, RowRule
from freetoken.layers.linear import Linear
from freetoken.layers.moe import Experts
from freetoken.distributed import parts
from freetoken.distributed.parts import ColumnParts, RowParts, compute_in_parts
from freetoken.distributed.tensor_parallel import shard_model
from freetoken.models.registry import architecture, model_class
from tests.model_fixtures import default_folder
from tests.support.parallel import OneRank


def _meta_model(folder):
    hf_config = json.loads((folder / "config.json").read_text())
    with torch.device("meta"):
        return model_class(architecture(hf_config)).from_hf(hf_config)


def _shapes(layer) -> tuple[int, int, bool]:
    return layer.in_features, layer.out_features, layer.bias is not None


@pytest.mark.slow  # the default model's folder
@pytest.mark.parametrize("fixture", ["default", "tiny_qwen3_moe_path", "tiny_gpt_oss_path"])
def test_each_part_has_the_shape_of_its_rank(fixture, request, monkeypatch):
    # The default model splits unevenly: 3 kv heads (9 query heads) over 2.
    folder = default_folder() if fixture == "default" else request.getfixturevalue(fixture)
    whole = _meta_model(folder)
    # As where no column-parallel layer's columns come out alike: every layer cut.
    monkeypatch.setattr(parts, "columns_alike", lambda layer, rows, padded=0: False)
    compute_in_parts(whole)
    for rank in range(2):
        ranked = _meta_model(folder)
        shard_model(ranked, OneRank(rank, 2))
        pairs = [(whole.lm_head.parts[rank], ranked.lm_head)]
        for ours, theirs in zip(whole.model.layers, ranked.model.layers):
            for name in ("qkv_proj", "o_proj"):
                pairs.append((getattr(ours.self_attn, name).parts[rank], getattr(theirs.self_attn, name)))
            if isinstance(ours.mlp, Experts):
                assert ours.mlp.down_parts[rank] == slice(rank * theirs.mlp.experts[0].down_proj.in_features,
                                                          (rank + 1) * theirs.mlp.experts[0].down_proj.in_features)
                pairs += [(a.down_proj.parts[rank], b.down_proj)
                          for a, b in zip(ours.mlp.experts, theirs.mlp.experts)]
            else:
                pairs += [(getattr(ours.mlp, name).parts[rank], getattr(theirs.mlp, name))
                          for name in ("gate_up_proj", "down_proj")]
        for ours, theirs in pairs:
            assert _shapes(ours) == _shapes(theirs)


def test_parts_compute_the_layer():
    torch.manual_seed(0)
    layer = Linear(24, 12, bias=True).requires_grad_(False)
    x = torch.randn(5, 24)
    reference = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    # Each part takes pieces of the output from both ends, as a rank's q | k | v rows do.
    columns = ColumnParts(layer, [[range(0, 3), range(8, 10)], [range(3, 8), range(10, 12)]])
    assert [part.out_features for part in columns.parts] == [5, 7]
    torch.testing.assert_close(columns(x).double(), reference)
    rows = RowParts(layer, [range(0, 10), range(10, 24)])
    assert [part.bias is not None for part in rows.parts] == [True, False]  # added once
    torch.testing.assert_close(rows(x).double(), reference)
    # The LM head's parts are padded to one row count; the padding is cut off.
    padded = ColumnParts(layer, [[range(0, 7)], [range(7, 12)]], padded=7)
    assert [part.out_features for part in padded.parts] == [7, 7]
    torch.testing.assert_close(padded(x).double(), reference)


def _fake_choose(width_dependent: bool, calls: list):
    """A kernel whose columns are float64 dot products, each its own (the same bits at any width), or, as a
    kernel whose blocking of K follows the GEMM's width would be, one whose bits depend on it."""
    def choose(layer):
        calls.append(layer.out_features)
        weight = layer.weight.detach().double()

        def run(x):
            # A matrix-vector product a column: a float64 GEMM's blocking may follow the width.
            y = torch.stack([x.double() @ column for column in weight], dim=1)
            return (y * (1 + 1e-6 * layer.out_features) if width_dependent else y).to(x.dtype)
        return Measured("fake", RowRule(), 1.0), True, run
    return choose


@pytest.mark.parametrize("width_dependent", [False, True])
def test_column_layers_stay_whole_only_where_the_probe_finds_columns_alike(width_dependent, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(parts, "choose", _fake_choose(width_dependent, calls))
    layer = Linear(24, 12, bias=True).requires_grad_(False)
    rows = [[range(0, 3), range(8, 10)], [range(3, 8), range(10, 12)]]
    computed = parts._columns(layer, rows)
    if width_dependent:  # the cut: each part the shape a rank holds
        assert isinstance(computed, ColumnParts) and [p.out_features for p in computed.parts] == [5, 7]
    else:
        assert computed is layer
    assert sorted(calls) == [5, 7, 12]
    # Kept per machine: a second load probes nothing.
    assert parts._columns(layer, rows).__class__ is computed.__class__ and len(calls) == 3
