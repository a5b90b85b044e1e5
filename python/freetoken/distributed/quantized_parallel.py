"""A tensor-parallel rank's layers kept in GGUF block formats (layers/quantized.py): the
rank's pieces of a GGUF's tensors, read whole from the memory-mapped file, cut as RankPart
(tensor_parallel.py) cuts a checkpoint's, and its layers put in place with their collectives.

Blocks are never cut: a column-parallel layer (q/k/v, gate/up, the experts' gate/up) and a
vocabulary part (the embedding, the LM head) keep whole rows of blocks, a row-parallel one
(`o_proj`, `down_proj`, the experts' down) the blocks of its part of K in each row, a view of
the file's bytes (the kernels read strided rows). Where a rank's part of K would start or end
inside a block (a K-quant's 256 values over heads of 64, say), that weight is dequantized on the
rank, with one log line (experts: with their gate/up, layers/moe.py's take_stacked_experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from freetoken.kernels.quant import QuantizedWeight, dequantize
from freetoken.distributed.parts import EXACT_PARTS, block_part, quantized_columns
from freetoken.layers.quantized import QuantizedEmbedding, QuantizedLinear, install
from freetoken.distributed.tensor_parallel import (Gathered, RankPart, RowParallelLinear, Summed,
                                                   VocabParallelEmbedding, VocabParallelHead, VocabRows)


class RowParallelQuantized(Summed, QuantizedLinear):
    def __init__(self, layer: QuantizedLinear, group):
        super().__init__(layer.parts, None if layer.bias is None else layer.bias.detach())
        self.group = group


class QuantizedVocabParallelHead(Gathered, QuantizedLinear):
    def __init__(self, weight: QuantizedWeight, vocab_size: int, group):
        super().__init__([weight], None)
        self.vocab_size, self.group = vocab_size, group


class QuantizedVocabParallelEmbedding(VocabRows, QuantizedEmbedding):
    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, rows: range, group):
        super().__init__(weight, dtype)
        self.rows, self.group = rows, group


def install_quantized(model: nn.Module, quantized: dict[str, list], dtype: torch.dtype) -> None:
    """quantized.install, a rank's row-parallel layers and vocabulary parts (as shard_model made
    them) keeping their collectives."""
    before = {name: model.get_submodule(name) for name in quantized}
    vocabulary = (VocabParallelEmbedding, VocabParallelHead)
    install(model, {name: parts for name, parts in quantized.items()
                    if not isinstance(before[name], vocabulary)}, dtype)
    for name, old in before.items():
        weight = quantized[name][0]
        if isinstance(old, VocabParallelEmbedding):
            model.set_submodule(name, QuantizedVocabParallelEmbedding(weight, dtype, old.rows, old.group))
        elif isinstance(old, VocabParallelHead):
            model.set_submodule(name, QuantizedVocabParallelHead(weight, old.vocab_size, old.group))
        elif isinstance(old, RowParallelLinear):
            model.set_submodule(name, RowParallelQuantized(model.get_submodule(name), old.group))


def quantized_head(embedding: QuantizedEmbedding, head: nn.Module) -> QuantizedLinear:
    """The LM head tied to a quantized embedding: a vocabulary part's, as `head` was, or whole."""
    if isinstance(head, VocabParallelHead):
        return QuantizedVocabParallelHead(embedding.weight, head.vocab_size, head.group)
    return QuantizedLinear([embedding.weight], None)


def shard_state(state: dict[str, torch.Tensor | QuantizedWeight], part: RankPart,
                widened: list[str]) -> dict[str, torch.Tensor | QuantizedWeight]:
    """`part`'s pieces of tensors read whole (a GGUF's, on its memory map): quantized weights cut
    along whole blocks, as views where one range is kept; a weight whose K a rank's part would
    cut inside a block dequantized (its name added to `widened`)."""
    pieces = {}
    for name, value in state.items():
        piece = part(name, Held(name, value, widened))
        if piece is not None:
            pieces[name] = piece
    return pieces


@dataclass
class Held:
    """A tensor in memory, read as models/checkpoint.py's StoredTensor is (for RankPart)."""

    name: str
    value: torch.Tensor | QuantizedWeight
    widened: list[str]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def read(self, dim: int = 0, ranges: list[range] | None = None) -> torch.Tensor | QuantizedWeight:
        value = self.value
        if ranges is None:
            return value
        if isinstance(value, QuantizedWeight):
            if dim < len(value.shape) - 1:  # rows (of each expert): whole rows of blocks
                data = value.data.narrow(dim, ranges[0].start, len(ranges[0])) if len(ranges) == 1 \
                    else torch.cat([value.data.narrow(dim, r.start, len(r)) for r in ranges], dim)
                shape = (*value.shape[:dim], data.shape[dim], *value.shape[dim + 1:])
                return QuantizedWeight(value.qtype, data, shape)
            if len(ranges) == 1 and (sliced := quantized_columns(value, ranges[0])) is not None:
                return sliced
            self.widened.append(self.name)
            value = dequantize(value)
        return torch.cat([value.narrow(dim, r.start, len(r)) for r in ranges], dim)


def widen_cut_experts(state: dict[str, torch.Tensor | QuantizedWeight], block: int,
                      parts: int = EXACT_PARTS) -> list[str]:
    """Where one process computes as `parts` ranks would (layers/parts.py): each stacked
    experts' down weight whose parts of K (whole blocks of `block` where they can be) would cut
    a block, dequantized as those ranks' are (their names returned)."""
    widened = []
    for name, value in state.items():
        if name.endswith(".experts.down_proj.weight") and isinstance(value, QuantizedWeight):
            k = value.shape[-1]
            if any(quantized_columns(value, block_part(k, p, parts, block)) is None for p in range(parts)):
                state[name] = dequantize(value)
                widened.append(name)
    return widened
