"""One process computing its layers as the ranks of a tensor-parallel split of EXACT_PARTS
would (distributed/tensor_parallel.py), so that tensor-parallel sizes 1 and 2 give the same
bits.

Tensor parallelism changes two things in a layer's arithmetic. A row-parallel layer (`o_proj`,
`down_proj`, the experts' down projections) becomes partial products over parts of its input
features, added over the ranks in rank order: another order of additions than one GEMM over all
of them. So a single process computes every such layer in those parts of its K, added in part
order, as the ranks' are (`RowParts`; a quantized layer's parts are whole blocks of its rows,
read in place, computed in one kernel call). A column-parallel layer (`qkv_proj`,
`gate_up_proj`, the LM head) runs a GEMM of fewer columns on a rank, and a kernel may give a
column other bits in a GEMM of another width. Whether the kernels chosen here do is probed at
load (`columns_alike`: the kernel the row probe of kernel_choice.py picks for the whole shape
against the ones it picks for the ranks' shapes, on weights that expose summation order, bit
for bit); where they agree the layer stays whole, where not it runs as the ranks' parts
(`ColumnParts`), each a `Linear` of a rank's very shape, so that the probe picks the same
kernel for it with the same row rule. The quantized kernels compute each output on its own
(kernels/quant_gemm.c), so quantized column-parallel layers stay whole. The MoE experts'
gate/up projections stay whole: the grouped kernel computes each column on its own
(grouped_gemm.c), so their width does not matter.

Only on CPU (on CUDA the ranks' sum is NCCL's all-reduce, whose order is its own). Asked for
with FREETOKEN_EXACT_TP=1 (models/registry.py); without it, done where it costs about nothing
(`free_in_parts`: every sliced layer quantized on the kernel, experts included, each
row-parallel one's parts whole blocks).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from gguf import GGML_QUANT_SIZES
from torch import nn

from freetoken.kernels.quant import QuantizedWeight, dequantize
from freetoken.layers.kernel_choice import RowRule, probe_rows, probe_weight, probed_once
from freetoken.layers.linear import Linear, candidates, choose
from freetoken.layers.moe import Experts
from freetoken.layers.quantized import QuantizedLinear
from freetoken.layers.skeleton import on_meta

# Tensor-parallel sizes whose ranks compute what one process computes: those dividing it.
EXACT_PARTS = 2


def even_part(n: int, rank: int, world: int) -> range:
    """`rank`'s part of n items cut into `world` contiguous parts that differ by one at most."""
    return range(rank * n // world, (rank + 1) * n // world)


def block_part(n: int, rank: int, world: int, block: int) -> range:
    """`rank`'s part of n items in whole blocks of `block`, or `even_part` where n is not whole
    blocks or there are fewer blocks than ranks."""
    if block == 1 or n % block or n // block < world:
        return even_part(n, rank, world)
    return scaled(even_part(n // block, rank, world), block)


def head_split(heads: int, kv_heads: int, rank: int, world: int) -> tuple[range, range]:
    """(query heads, kv heads) that `rank` holds: whole groups (a kv head and its query heads),
    as evenly as the number of groups allows; with fewer kv heads than ranks, each kv head
    replicated on the ranks that split its query heads."""
    per_group = heads // kv_heads
    if world <= kv_heads:
        kv = even_part(kv_heads, rank, world)
        return range(kv.start * per_group, kv.stop * per_group), kv
    group = rank * kv_heads // world
    sharing = [r for r in range(world) if r * kv_heads // world == group]
    if per_group < len(sharing):
        raise ValueError(f"{world} ranks cannot split {heads} attention heads "
                         f"({kv_heads} kv heads): every rank needs one query head at least")
    q = even_part(per_group, sharing.index(rank), len(sharing))
    first = group * per_group
    return range(first + q.start, first + q.stop), range(group, group + 1)


def vocab_part(vocab: int, rank: int, world: int) -> tuple[range, int]:
    """`rank`'s rows of the vocabulary, and the rows each part is padded to."""
    per_rank = -(-vocab // world)
    return range(min(vocab, rank * per_rank), min(vocab, (rank + 1) * per_rank)), per_rank


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    with on_meta():
        layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


class ColumnParts(nn.Module):
    """A layer's output features computed by parts: part p computes `rows[p]` (ranges of the
    layer's output features, in that order), its weight padded with zero rows to `padded`
    rows; the outputs are put back in the layer's order."""

    def __init__(self, layer: Linear, rows: list[list[range]], padded: int = 0):
        super().__init__()
        self.out_features = layer.out_features
        parts, self.pieces = [], []  # pieces: (part, first column in it, first column in out, count)
        for p, ranges in enumerate(rows):
            first = 0
            for r in ranges:
                self.pieces.append((p, first, r.start, len(r)))
                first += len(r)
            # Row slices are views: a tied head's parts still share the embedding's storage.
            weight = torch.cat([layer.weight[r.start : r.stop] for r in ranges]) if len(ranges) > 1 \
                else layer.weight[ranges[0].start : ranges[0].stop]
            bias = None if layer.bias is None else torch.cat([layer.bias[r.start : r.stop] for r in ranges])
            if padded > first:
                weight = torch.cat([weight, weight.new_zeros(padded - first, weight.shape[1])])
                bias = None if bias is None else torch.cat([bias, bias.new_zeros(padded - first)])
            parts.append(_linear(weight, bias))
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [part(x) for part in self.parts]
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for p, first, at, count in self.pieces:
            out[..., at : at + count] = outs[p][..., first : first + count]
        return out


class RowParts(nn.Module):
    """A layer's input features cut into the ranges `cols`, each part's partial product added in
    part order (the bias in the first), as a tensor-parallel group's sum adds its ranks'."""

    def __init__(self, layer: Linear | QuantizedLinear, cols: list[range], dtype: torch.dtype | None = None):
        super().__init__()
        self.cols = cols
        self.parts = nn.ModuleList(k_part(layer, c, p == 0, dtype) for p, c in enumerate(cols))
        # Every part whole blocks on the quantized kernel: one call computes the parts' sums and
        # adds them in order (quant_gemm.c's item_parts; int8_gemm.c alike, on the layer's
        # arithmetic), x read in place, with these very bits in float32 (other dtypes round each
        # part's product first: the parts run apart).
        self.fused = type(layer.fused)(layer.parts, layer.part_bias, cols) if (
            isinstance(layer, QuantizedLinear) and layer.fused is not None
            and all(isinstance(part, QuantizedLinear) for part in self.parts)) else None
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.dtype == torch.float32:
            return self.fused(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        # Each part's input contiguous, as a rank's own is.
        out, *rest = [part(x[..., c.start : c.stop].contiguous()) for part, c in zip(self.parts, self.cols)]
        for partial in rest:
            out += partial
        return out


def k_part(layer: Linear | QuantizedLinear, cols: range, with_bias: bool,
           dtype: torch.dtype | None = None) -> Linear | QuantizedLinear:
    """The input features `cols` of `layer` as the layer a rank holds: a quantized weight's whole
    blocks of each row, read in place; a weight whose blocks `cols` would cut, dequantized to
    `dtype` (as a rank's is: tensor_parallel.RankPart)."""
    bias = layer.bias if with_bias else None
    if isinstance(layer, Linear):
        return _linear(layer.weight[:, cols.start : cols.stop].contiguous(), bias)
    (weight,) = layer.parts  # row-parallel layers are not fused
    if isinstance(weight, QuantizedWeight):
        if (sliced := quantized_columns(weight, cols)) is not None:
            return QuantizedLinear([sliced], None if bias is None else bias.detach())
        weight = dequantize(weight).to(dtype)
    return _linear(weight[:, cols.start : cols.stop].contiguous(), bias)


def quantized_columns(weight: QuantizedWeight, cols: range) -> QuantizedWeight | None:
    """Input features `cols` of a [N, K] quantized weight, a view of whole blocks of each row;
    None where `cols` does not start and end on block boundaries."""
    block, size = GGML_QUANT_SIZES[weight.qtype]
    if cols.start % block or cols.stop % block:
        return None
    data = weight.data[..., cols.start // block * size : cols.stop // block * size]
    return QuantizedWeight(weight.qtype, data, (*weight.shape[:-1], len(cols)))


COLUMN_ROWS = (1, 3, 17, 65)  # one count below, inside and past each row rule's minimum


def columns_alike(layer: Linear, rows: list[list[range]], padded: int = 0) -> bool:
    """Do the kernels chosen for `layer`'s shape and for the shapes of its column parts `rows`
    (as ColumnParts cuts them) give every output column the same bits, at every row count?
    Probed on `probe_weight`'s weights (outputs that are summation-order residue alone), once
    per shape on this machine."""
    weight = layer.weight
    key = (f"columns {weight.dtype} {weight.device.type} {layer.in_features}x{layer.out_features}"
           f"{' bias' if layer.bias is not None else ''} {[[(r.start, r.stop) for r in p] for p in rows]}"
           f" {padded} {','.join(candidates())}")
    known = probed_once(key, lambda: None)  # read only: the probe chooses kernels, under the same lock
    if known is None:
        alike = _probe_columns(layer, rows, padded)
        probed_once(key, lambda: alike)
        return alike
    return known


@torch.inference_mode()
def _probe_columns(layer: Linear, rows: list[list[range]], padded: int) -> bool:
    weight = layer.weight
    whole = _linear(probe_weight(layer.out_features, layer.in_features, weight.dtype).to(weight.device),
                    None if layer.bias is None
                    else torch.randn(layer.out_features, generator=torch.Generator().manual_seed(3))
                    .to(dtype=layer.bias.dtype, device=weight.device))
    parts = ColumnParts(whole, rows, padded)
    for probe in [whole, *parts.parts]:
        if (chosen := choose(probe)) is not None:
            best, _, run = chosen
            probe.run, probe.rule = run, best.rule or RowRule()
    x = probe_rows(max(COLUMN_ROWS), layer.in_features, weight.dtype).to(weight.device)
    return all(torch.equal(whole(x[:n]), parts(x[:n])) for n in COLUMN_ROWS)


def _columns(layer: nn.Module, rows: list[list[range]], padded: int = 0) -> nn.Module:
    """`layer` whole where its columns come out alike whatever the part, else in parts."""
    if isinstance(layer, QuantizedLinear) or columns_alike(layer, rows, padded):
        return layer
    return ColumnParts(layer, rows, padded)


def free_in_parts(model: nn.Module, parts: int = EXACT_PARTS) -> bool:
    """Does computing `model` in parts cost about nothing: float32 rows, every sliced layer
    quantized on the kernel (column-parallel ones then stay whole), each row-parallel one's parts
    whole blocks (computed in one call: RowParts.fused), and so are experts' down projections
    (one grouped call: `_whole_blocks`)? docs/engine/tensor-parallel.md, "What it costs"."""
    cfg = model.cfg
    if (cfg.num_kv_heads < parts or model.model.norm.weight.dtype != torch.float32
            or not _on_kernel(model.lm_head)):
        return False
    q_cols = [scaled(q, cfg.head_dim) for q, _ in _head_splits(cfg, parts)]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(mlp, Experts):  # its router and any shared expert stay whole on every rank
            if mlp.quantized is None or _whole_blocks(mlp, parts, model.experts_block) is None:
                return False
            column, row = [attn.qkv_proj], [(attn.o_proj, q_cols)]
        else:
            down_cols = [even_part(mlp.down_proj.in_features, p, parts) for p in range(parts)]
            column, row = [attn.qkv_proj, mlp.gate_up_proj], [(attn.o_proj, q_cols), (mlp.down_proj, down_cols)]
        if not all(_on_kernel(m) for m in column + [m for m, _ in row]):
            return False
        for row_parallel, cols in row:
            if any(quantized_columns(row_parallel.parts[0], c) is None for c in cols):
                return False
    return True


def _on_kernel(layer: nn.Module) -> bool:
    return type(layer) is QuantizedLinear and layer.fused is not None


def _head_splits(cfg, parts: int) -> list[tuple[range, range]]:
    return [head_split(cfg.num_heads, cfg.num_kv_heads, p, parts) for p in range(parts)]


def compute_in_parts(model: nn.Module, parts: int = EXACT_PARTS) -> None:
    """Put the sliced layers of `model` (a models/llama.py decoder or a family built on it,
    loaded whole, its experts stacked or not) in `parts` parts, cut as `parts` ranks are."""
    cfg, d = model.cfg, model.cfg.head_dim
    if cfg.num_kv_heads < parts:
        return  # kv heads replicated over ranks: each rank attends with its own copy, not here
    splits = _head_splits(cfg, parts)
    q_rows = [scaled(q, d) for q, _ in splits]
    k_first, v_first = cfg.num_heads * d, (cfg.num_heads + cfg.num_kv_heads) * d
    dtype = model.model.norm.weight.dtype  # a quantized layer's dequantized parts
    qkv_rows = [[q, scaled(kv, d, k_first), scaled(kv, d, v_first)]
                for q, (_, kv) in zip(q_rows, splits)]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _columns(attn.qkv_proj, qkv_rows)
        attn.o_proj = RowParts(attn.o_proj, q_rows, dtype)
        if isinstance(mlp, Experts):
            _experts_in_parts(mlp, parts, model.experts_block)
            continue
        size = mlp.down_proj.in_features
        cols = [even_part(size, p, parts) for p in range(parts)]
        mlp.gate_up_proj = _columns(mlp.gate_up_proj, [[c, scaled(c, 1, size)] for c in cols])
        mlp.down_proj = RowParts(mlp.down_proj, cols, dtype)
    vocab = [vocab_part(cfg.vocab_size, p, parts) for p in range(parts)]
    model.lm_head = _columns(model.lm_head, [[rows] for rows, _ in vocab], padded=vocab[0][1])


def _experts_in_parts(experts: Experts, parts: int, block: int) -> None:
    """The experts' down projections in parts of the intermediate size (whole blocks of `block`
    where they can be, as tensor_parallel.RankPart cuts them), each part's weighted sum added in
    part order (moe.Experts.down_parts); gate/up stays whole. Quantized experts' parts are whole
    blocks, computed in one kernel call (`_whole_blocks`); where a part would cut a block they stay
    whole (the loader dequantizes a GGUF's such experts first: loader.build_gguf)."""
    if experts.quantized is not None:
        if (cols := _whole_blocks(experts, parts, block)) is not None:
            experts.quantized = replace(experts.quantized, down_cuts=tuple(cols))
        return
    if experts.stacked:
        gate_up, (down,) = experts.stacked
        cols = [block_part(down.in_features, p, parts, block) for p in range(parts)]
        # The packed layout is [E, strips, K, 16]: a part of K is a slice of dimension 2.
        experts.stacked = (gate_up, tuple(
            replace(down, weight=down.weight[:, :, c.start : c.stop].contiguous(),
                    bias=down.bias if p == 0 else None, in_features=len(c))
            for p, c in enumerate(cols)))
    else:
        cols = [block_part(experts.experts[0].down_proj.in_features, p, parts, block) for p in range(parts)]
        for expert in experts.experts:
            expert.down_proj = RowParts(expert.down_proj, cols)
    experts.down_parts = tuple(slice(c.start, c.stop) for c in cols)


def _whole_blocks(experts: Experts, parts: int, block: int) -> list[range] | None:
    """The parts of K of quantized `experts`' down projection, as ranks hold them, where each is
    whole blocks of its format (else None)."""
    down = experts.quantized.down
    cols = [block_part(down.shape[-1], p, parts, block) for p in range(parts)]
    return cols if all(quantized_columns(down, c) is not None for c in cols) else None


def scaled(items: range, size: int, offset: int = 0) -> range:
    """The rows of `items` in a block of items `size` rows each, starting at row `offset`."""
    return range(offset + items.start * size, offset + items.stop * size)
