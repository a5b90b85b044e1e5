"""Reading safetensors files without mapping them: whole tensors and slices of any dimension,
checked against safetensors' own reader and torch's indexing."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.models import checkpoint
from freetoken.models.checkpoint import read_weights


@pytest.fixture
def folder(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, 5, generator=gen), "b": torch.randn(3, 6, 4, generator=gen).bfloat16(),
               "c": torch.arange(10, dtype=torch.int64), "d": torch.randint(0, 255, (2, 5, 3, 4), generator=gen,
                                                                       dtype=torch.uint8)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


def test_whole_tensors_read_as_safetensors_reads_them(folder):
    ours, theirs = read_weights(folder), load_file(folder / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("chunk", [1, 64, 1 << 20])  # bytes: a leading index at a time, a few, all
def test_slices_of_every_dimension_match_torch_indexing(folder, chunk, monkeypatch):
    monkeypatch.setattr(checkpoint, "READ_CHUNK", chunk)
    theirs = load_file(folder / "model.safetensors")
    cases = {"a": [(0, [range(2, 5)]), (1, [range(0, 2), range(3, 5)])],
             "b": [(0, [range(1, 3)]), (1, [range(0, 1), range(4, 6)]), (2, [range(1, 3)])],
             "c": [(0, [range(0, 0), range(9, 10)])],
             "d": [(2, [range(1, 2)]), (3, [range(0, 4)])]}

    def piece(name, stored):
        pieces[name] = [stored.read(dim, ranges) for dim, ranges in cases[name]]
        return stored.read()

    pieces: dict = {}
    read_weights(folder, piece)
    for name, reads in cases.items():
        for (dim, ranges), got in zip(reads, pieces[name]):
            index = torch.cat([torch.arange(r.start, r.stop) for r in ranges])
            assert torch.equal(got, theirs[name].index_select(dim, index)), (name, dim)


def test_a_part_that_returns_none_leaves_the_tensor_out(folder):
    assert read_weights(folder, lambda name, stored: None if name == "a" else stored.read()).keys() == {"b", "c", "d"}
