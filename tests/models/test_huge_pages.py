"""models/huge_pages.py: quantized weights copied as stored into one huge-page region, the file's
pages under them let go."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from freetoken.config import WeightsConfig
from freetoken.models import huge_pages, registry
from freetoken.kernels import quant
from tests.fixtures import build_models as bm


def _mapping(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`, and its file ("path")."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = start <= address < end
            fields["path"] = " ".join(line.split()[5:])  # empty for anonymous memory
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.fixture(autouse=True)
def _copies_on(monkeypatch):
    """The suite turns the copy off (tests/conftest.py); these tests are about it."""
    monkeypatch.delenv("FREETOKEN_HUGE_PAGES", raising=False)


needs_huge_pages = pytest.mark.skipif(not huge_pages.huge_pages_available(),
                                      reason="this kernel gives no transparent huge pages (mode never)")


@needs_huge_pages
def test_weights_are_copied_as_stored_into_a_region_eligible_for_huge_pages():
    q4 = quant.random_weight(GGMLQuantizationType.Q4_1, (96, 576), seed=1)
    q8 = quant.random_weight(GGMLQuantizationType.Q8_0, (64, 576), seed=2)
    norm = torch.ones(576)
    state = huge_pages.place_in_huge_pages({"a": q4, "b": q8, "norm": norm})
    assert state["norm"] is norm
    x = torch.randn(3, 576)
    for name, source in (("a", q4), ("b", q8)):
        placed = state[name]
        assert (placed.qtype, placed.shape) == (source.qtype, source.shape)
        assert torch.equal(placed.data, source.data)
        assert placed.data.untyped_storage().data_ptr() != source.data.untyped_storage().data_ptr()
        assert placed.data.data_ptr() % huge_pages.ALIGN == 0
        assert _mapping(placed.data.data_ptr())["THPeligible"] == "1"
        assert torch.equal(quant.quant_linear(x, placed, None), quant.quant_linear(x, source, None))


@needs_huge_pages
def test_a_gguf_loads_its_kept_blocks_into_huge_pages():
    path = bm.cached_gguf("tiny-quantized-llama")
    model = registry.load_model(path / "model.gguf", dtype="float32", device="cpu", weights=WeightsConfig(gguf_weights="quantized"))
    parts = [*model.model.model.layers[0].self_attn.qkv_proj.parts, model.model.model.embed_tokens.weight]
    assert {p.qtype.name for p in parts} >= {"Q8_0"} and len(parts) == 4
    for part in parts:  # q and k (rows permuted at load), v, and the tied Q8_0 embedding
        mapping = _mapping(part.data.data_ptr())
        assert mapping["path"] == "" and mapping["THPeligible"] == "1"


@needs_huge_pages
@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_the_files_pages_under_a_copied_weight_are_let_go(tmp_path):
    # Two files, as a split GGUF's parts: each weight is read from, and let go on, its own.
    weights = [quant.random_weight(GGMLQuantizationType.Q4_0, (4096, 512), seed=s) for s in (3, 4)]  # 1.1 MiB
    sources, mapped = [], {}
    for i, weight in enumerate(weights):
        path = tmp_path / f"blocks-{i}.bin"
        path.write_bytes(weight.data.numpy().tobytes())
        sources.append(np.memmap(path, mode="r"))
        view = torch.from_numpy(np.asarray(sources[-1])).view(weight.data.shape)
        mapped[f"w{i}"] = quant.QuantizedWeight(weight.qtype, view, weight.shape)
        assert int(view.sum()) == int(weight.data.sum())  # every page of the map read in
        assert int(_mapping(sources[-1].ctypes.data)["Rss"].split()[0]) >= 1024
    state = huge_pages.place_in_huge_pages(dict(mapped), sources)
    for i, (weight, source) in enumerate(zip(weights, sources)):
        assert int(_mapping(source.ctypes.data)["Rss"].split()[0]) == 0
        assert torch.equal(state[f"w{i}"].data, weight.data)
        assert int(mapped[f"w{i}"].data.sum()) == int(weight.data.sum())  # the map still reads (page cache)


def test_without_huge_pages_the_weights_stay_where_they_are(tmp_path, monkeypatch):
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_MODE", mode)
    assert not huge_pages.huge_pages_available()
    weight = quant.random_weight(GGMLQuantizationType.Q4_1, (32, 576))
    assert huge_pages.place_in_huge_pages({"w": weight})["w"] is weight
    mode.write_text("always [madvise] never\n")
    assert huge_pages.huge_pages_available() == hasattr(__import__("mmap"), "MADV_HUGEPAGE")
    monkeypatch.setenv("FREETOKEN_HUGE_PAGES", "0")  # turned off, as `--huge-pages off` does
    asked = WeightsConfig().resolved().huge_pages
    assert asked is False and not huge_pages.copies_to_huge_pages(asked)
    assert huge_pages.place_in_huge_pages({"w": weight}, asked=asked)["w"] is weight
