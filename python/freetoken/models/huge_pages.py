"""Quantized weights moved off the file's map into memory the kernel backs with transparent huge
pages.

A decode step at batch 1 reads each weight byte once, front to back; on the 4 KiB pages of a mapped
file that is a page-table walk every 4 KiB, and the quantized kernel's fetches ahead
(quant_gemm.c's FETCH_AHEAD) stall on them. In 2 MiB pages the default GGUF decodes one client
1.10-1.17x as fast (Zen 4, 2 threads; benchmarks/results/2026-12-03-zen4.md). The blocks are copied
as stored (the same bytes, the same results) into one region asked for huge pages (madvise): read
from the file (its page cache) where a weight is whole, copied off the map where it is a slice (a
tensor-parallel rank's part of K), the map's pages then let go; so the load holds about one copy of
the weights at any time, as reading them in place did. Where the kernel grants no huge pages (the
mode `never`, or no madvise), or where `--huge-pages off` asks so (a faster load: the copy's
first touch costs a VM 0.3-1 s for the default model), the weights stay on the map.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Sequence
from contextlib import ExitStack
from functools import cache
from pathlib import Path

import numpy as np
import torch

from freetoken.kernels.quant import QuantizedWeight

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each weight starts on a cache line
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Does the kernel give huge pages to a region that asks (mode `always` or `madvise`)?"""
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in mode


def copies_to_huge_pages(asked: bool | None = None) -> bool:
    """Will a load copy its weights into huge pages here: available, and not `asked` off
    (config.WeightsConfig.huge_pages, resolved)?"""
    return asked is not False and huge_pages_available()


def place_in_huge_pages(state: dict, sources: Sequence[np.memmap] = (), asked: bool | None = None) -> dict:
    """`state` with each QuantizedWeight's blocks copied into one huge-page region (the others as
    they are); `sources`: the maps of the files (a split GGUF's parts) whose pages under each
    copied weight are released."""
    weights = {name: w for name, w in state.items() if isinstance(w, QuantizedWeight)}
    if not weights or not copies_to_huge_pages(asked):
        return state
    total = sum(_padded(w.nbytes) for w in weights.values())
    # Whole huge pages from a boundary on: room to align the start, and the end a whole page.
    region = mmap.mmap(-1, _padded(total, HUGE_PAGE) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` while a weight lives
    at = (-arena.data_ptr()) % HUGE_PAGE
    with ExitStack() as files:
        opened = [files.enter_context(open(source.filename, "rb", buffering=0)) for source in sources]
        for name, weight in weights.items():
            blocks = arena[at : at + weight.nbytes].view(weight.data.shape)
            on = next(((source, file, offset) for source, file in zip(sources, opened)
                       if (offset := _file_offset(weight.data, source)) is not None), None)
            if on is not None and weight.data.is_contiguous():
                _read(on[1], on[2], memoryview(region)[at : at + weight.nbytes])
            else:  # a rank's slice along K (rows apart), or a copy made at load
                blocks.copy_(weight.data)
            if on is not None:
                _release(weight.data, on[0])
            state[name] = QuantizedWeight(weight.qtype, blocks, weight.shape)
            at += _padded(weight.nbytes)
    log.info("%d quantized weights (%.0f MiB) copied into huge pages", len(weights), total / 2**20)
    return state


def _padded(nbytes: int, to: int = ALIGN) -> int:
    return -(-nbytes // to) * to


def _file_offset(data: torch.Tensor, source: np.memmap) -> int | None:
    """Where `data` starts in the file, if it lies on `source`, the file's map from its start
    (not a copy made at load, as a llama's q/k rows are)."""
    first, base = data.data_ptr(), source.ctypes.data
    return first - base if base <= first < base + source.nbytes else None


def _read(file, offset: int, into: memoryview) -> None:
    """The file's bytes from `offset` into `into`, straight from the page cache: no page of the
    map is touched (a read may return less than asked)."""
    done = 0
    while done < len(into):
        got = os.preadv(file.fileno(), [into[done:]], offset + done)
        if got <= 0:
            raise OSError(f"{file.name}: ended at byte {offset + done} while reading a weight")
        done += got


def _release(data: torch.Tensor, source: np.memmap) -> None:
    """Drop this process's mapping of the map's pages under `data` (a read-only map of the file:
    they stay in the page cache, and a later read maps them again)."""
    first = data.data_ptr()
    last = first + sum((n - 1) * s for n, s in zip(data.shape, data.stride())) + 1
    base = source.ctypes.data
    page = mmap.PAGESIZE
    start = first // page * page
    end = min(-(-last // page) * page, -(-(base + source.nbytes) // page) * page)
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


@cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
