"""A tensor-parallel rank reads only the slices it keeps: the pieces two ranks read of each
checkpoint tensor are smaller than it, and together make it up exactly, as safetensors' own
reader reads it (or are the whole of it, on each rank, where it is not split)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from freetoken.config import WeightsConfig
from freetoken.models import loader
from freetoken.layers.moe import Experts
from freetoken.distributed.parts import block_part, even_part
from freetoken.models.registry import load_model
from tests.model_fixtures import tiny_random_folder
from tests.support.parallel import OneRank


def rank_pieces(folder, rank: int, monkeypatch) -> tuple[dict, object]:
    """What `rank` of 2 read of each checkpoint tensor, and its loaded model."""
    pieces = {}

    def recording(folder, part=None, reads=lambda name: True):
        state = read(folder, part, reads)
        pieces.update(state)
        return state

    read = loader.read_weights
    monkeypatch.setattr(loader, "read_weights", recording)
    loaded = load_model(folder, dtype="float32", device="cpu", group=OneRank(rank, 2))
    monkeypatch.setattr(loader, "read_weights", read)
    return pieces, loaded


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["qwen3", "tiny_qwen3_moe_path", "tiny_gpt_oss_path",
                                     "tiny_gpt_oss_mxfp4_path"])
def test_each_rank_reads_only_its_part_and_the_parts_make_up_the_checkpoint(fixture, request,
                                                                            monkeypatch):
    folder = tiny_random_folder() if fixture == "qwen3" else request.getfixturevalue(fixture)
    full = load_file(folder / "model.safetensors")
    (first, model0), (second, model1) = (rank_pieces(folder, rank, monkeypatch) for rank in (0, 1))
    assert model0.model.cfg.num_heads == model1.model.cfg.num_heads == 2
    split = 0
    for name, tensor in full.items():
        a, b = first[name], second.get(name)
        if b is None:  # a bias added once, by rank 0
            assert name.endswith(("o_proj.bias", "down_proj.bias", "down_proj_bias")), name
            assert torch.equal(a, tensor)
            continue
        if a.shape == b.shape == tensor.shape:
            assert torch.equal(a, tensor) and torch.equal(b, tensor), name
            continue
        dim = next(d for d in range(tensor.dim()) if a.shape[d] != tensor.shape[d])
        assert a.numel() < tensor.numel() and b.numel() < tensor.numel(), name
        whole = torch.cat([a, b], dim=dim).narrow(dim, 0, tensor.shape[dim])
        assert torch.equal(whole, tensor), name
        split += 1
    # q/k/v/o and the (experts') gate/up/down of every layer, the embedding (and an untied head).
    assert split >= 7 * model0.model.cfg.num_layers + 1
    held = [sum(t.numel() for t in pieces.values()) for pieces in (first, second)]
    assert all(n < sum(t.numel() for t in full.values()) for n in held)


def test_block_part_splits_whole_blocks_as_evenly_as_they_go():
    # gpt-oss-20b's experts: 2880 = 90 MXFP4 blocks of 32, over 4 ranks 22, 23, 22 and 23 blocks
    # (an even split, 720 each, would cut blocks in half).
    parts = [block_part(2880, r, 4, 32) for r in range(4)]
    assert [len(p) for p in parts] == [704, 736, 704, 736] and all(p.start % 32 == 0 for p in parts)
    assert parts[0].start == 0 and parts[-1].stop == 2880
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    assert block_part(2880, 1, 4, 1) == even_part(2880, 1, 4)
    # Fewer blocks than ranks: the even split (an MXFP4 checkpoint then refuses it).
    assert [block_part(32, r, 2, 32) for r in range(2)] == [range(0, 16), range(16, 32)]


def test_mxfp4_experts_split_in_whole_blocks_sum_to_the_whole_layer(tiny_gpt_oss_mxfp4_path):
    """Two ranks' MXFP4 experts (one block of the intermediate size of 64 each, kept quantized;
    the down bias on rank 0 only): their partial outputs sum to the unsplit layer's."""
    folder = tiny_gpt_oss_mxfp4_path
    whole = load_model(folder, dtype="float32", device="cpu").model.model.layers[1].mlp
    parts = [load_model(folder, dtype="float32", device="cpu", group=OneRank(rank, 2)).model.model.layers[1].mlp
             for rank in (0, 1)]
    assert [p.quantized.down.shape for p in parts] == [(8, 64, 32)] * 2
    assert parts[0].quantized.down_bias is not None and parts[1].quantized.down_bias is None
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        top, ids = torch.topk(whole.router(x), whole.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
        expected = whole(x)
        for part in parts:
            part.sum_over_ranks = None  # summed here instead
        summed = sum(Experts.forward(part, x, ids, weights) for part in parts)
    assert (summed - expected).abs().max().item() < 1e-5


def test_a_gguf_rank_keeps_whole_blocks_and_dequantizes_a_cut_block(caplog):
    from gguf import GGML_QUANT_SIZES

    from freetoken.models.huge_pages import copies_to_huge_pages
    from freetoken.layers.quantized import QuantizedLinear
    from freetoken.distributed.quantized_parallel import RowParallelQuantized
    from freetoken.distributed.tensor_parallel import RowParallelLinear
    from tests.fixtures import build_models as bm

    caplog.set_level("INFO")
    path = bm.cached_gguf("tiny-quantized-llama") / "model.gguf"
    model = load_model(path, dtype="float32", device="cpu", group=OneRank(1, 2), weights=WeightsConfig(gguf_weights="quantized")).model
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, RowParallelQuantized)
    (weight,) = down.parts
    block, size = GGML_QUANT_SIZES[weight.qtype]
    # Rank 1's half of K (256 of 512): whole blocks of each row, as stored: copied alone into
    # huge pages where the kernel gives them (models/huge_pages.py), else read in place.
    assert weight.shape == (256, 256) and weight.data.shape[1] == 256 // block * size
    assert weight.data.stride(0) == (256 if copies_to_huge_pages(WeightsConfig().resolved().huge_pages) else 512) // block * size
    # Layer 0's o_proj is Q4_K: half of its K, 2 heads of 64, is half a block of 256.
    assert isinstance(model.model.layers[0].self_attn.o_proj, RowParallelLinear)
    assert "dequantized at load on rank 1, its part of K not whole blocks" in caplog.text
    assert "model.layers.0.self_attn.o_proj.weight" in caplog.text
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
