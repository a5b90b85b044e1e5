"""A folder's safetensors files, read tensor by tensor, or as the slices a tensor-parallel rank
keeps, with plain reads.

Not through safetensors' own reader: it maps the file, and every page a read touches then
counts in the process's resident memory until it exits, so a rank slicing columns (every row
of the tensor) or a whole-model load would show twice what it holds. The format is a
little-endian u64 header length, a JSON header (name -> dtype, shape, byte offsets from the end
of the header), then the tensors' bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import BinaryIO, Callable

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E5M2": torch.float8_e5m2}
READ_CHUNK = 16 << 20  # bytes read at once when slicing an inner dimension


class StoredTensor:
    """One tensor of an open safetensors file, not read yet."""

    def __init__(self, file: BinaryIO, offset: int, dtype: torch.dtype, shape: tuple[int, ...]):
        self.file, self.offset, self.dtype, self.shape = file, offset, dtype, shape

    def read(self, dim: int = 0, ranges: list[range] | None = None) -> torch.Tensor:
        """The tensor, or only the indices `ranges` of dimension `dim`, concatenated; an inner
        dimension is sliced READ_CHUNK bytes at a time, so no more than that is read and
        dropped at once."""
        if ranges is None:
            return self._read(0, self.shape)
        row = math.prod(self.shape[dim + 1:]) * self.dtype.itemsize
        if dim == 0:
            return _cat([self._read(r.start * row, (len(r), *self.shape[1:])) for r in ranges], 0)
        block = self.shape[dim] * row  # bytes per index of the leading dimensions
        lead = math.prod(self.shape[:dim])
        step = max(1, READ_CHUNK // max(block, 1))
        parts = []
        for first in range(0, lead, step):
            chunk = self._read(first * block, (min(step, lead - first), *self.shape[dim:]))
            parts.append(torch.cat([chunk.narrow(1, r.start, len(r)) for r in ranges], dim=1))
        return _cat(parts, 0).view(*self.shape[:dim], -1, *self.shape[dim + 1:])

    def _read(self, start: int, shape: tuple[int, ...]) -> torch.Tensor:
        size = math.prod(shape) * self.dtype.itemsize
        if size == 0:
            return torch.empty(shape, dtype=self.dtype)
        buffer = bytearray(size)
        view, done = memoryview(buffer), 0
        self.file.seek(self.offset + start)
        while done < size:
            got = self.file.readinto(view[done:])
            if not got:
                raise OSError(f"{self.file.name}: ends inside a tensor")
            done += got
        return torch.frombuffer(buffer, dtype=self.dtype).view(shape)


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def stored_tensors(file: BinaryIO) -> dict[str, StoredTensor]:
    header_size = int.from_bytes(file.read(8), "little")
    header = json.loads(file.read(header_size))
    header.pop("__metadata__", None)
    return {name: StoredTensor(file, 8 + header_size + entry["data_offsets"][0],
                               DTYPES[entry["dtype"]], tuple(entry["shape"]))
            for name, entry in header.items()}


def read_weights(folder: Path, part: Callable | None = None,
                 reads: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
    """The folder's tensors by name, those `reads` names. `part(name, stored)`: the piece of a
    tensor to keep (a tensor-parallel rank's, distributed/tensor_parallel.py), or None to skip it."""
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as file:
            for name, stored in stored_tensors(file).items():
                if not reads(name):
                    continue
                tensor = stored.read() if part is None else part(name, stored)
                if tensor is not None:
                    state[name] = tensor
    return state
