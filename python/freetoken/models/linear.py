"""Linear layers on oneDNN with weights packed once at load, where this CPU allows it.

torch's CPU `F.linear` goes through MKL, which on the AMD cores this was measured on runs 2-3x
below what oneDNN reaches on the same shapes (small M worst: decode rows are 1-32). Batch
invariance needs a row's bits not to depend on how many rows the call has. Measured here, MKL
gives that only when M is a multiple of 4; oneDNN for every M >= 2 (M = 1 takes a GEMV that
splits the reduction). That is a property of the kernels on a given CPU, not a promise, so
`pack_linears` checks it on the model's own shapes. Where oneDNN fails it or cannot run the
dtype (bfloat16 on a CPU without native bfloat16), the layers run on the grouped kernel of
grouped_gemm.c as one group each (any row count, float32 sums); where that cannot run either,
on `F.linear` with rows padded to MKL's rule.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.models.grouped_gemm import KERNELS, PackedLinears, grouped_gemm
from freetoken.models.grouped_gemm import load as load_kernel
from freetoken.models.grouped_gemm import pack as pack_strips


@dataclass(frozen=True)
class RowPadding:
    """Row counts at which a matmul gives each row the bits it gets in any other such count."""

    minimum: int
    multiple: int

    def pad(self, rows: int) -> int:
        """Padding rows to add to `rows`."""
        return max(self.minimum, -(-rows // self.multiple) * self.multiple) - rows


KERNEL_ROWS = RowPadding(minimum=1, multiple=1)
ONEDNN_ROWS = RowPadding(minimum=2, multiple=1)
MKL_ROWS = RowPadding(minimum=4, multiple=4)
# Each rule's row counts are allowed by the ones before it: steps padded to the last rule any
# process follows suit every process (tensor parallelism).
RULES = (KERNEL_ROWS, ONEDNN_ROWS, MKL_ROWS)
PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 33, 64)


def onednn_available(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


class Linear(nn.Linear):
    """`nn.Linear` (same parameter names, so state dicts load) that runs packed when asked."""

    # (oneDNN weight, bias): a plain attribute, read without nn.Module's parameter lookup.
    packed: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # (the grouped kernel, this layer's weights in its strips), where it runs on that instead.
    strips: tuple[ctypes.CDLL, PackedLinears] | None = None

    def pack(self) -> None:
        """Reorder the weight into oneDNN's blocked layout; call after the final dtype cast."""
        weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.packed = (weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.strips is not None:
            kernel, strips = self.strips
            flat = x.reshape(-1, self.in_features)
            return grouped_gemm(kernel, flat, strips).view(*x.shape[:-1], self.out_features)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        weight, bias = self.packed
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def rows_alike(layer: Linear, padding: RowPadding) -> bool:
    """Does every row count allowed by `padding` give the layer's first and last rows the same
    bits? The kernel alone is probed: a tensor-parallel layer's forward adds a collective, and
    ranks whose slices differ in shape probe different shapes."""
    return kernel_rows_alike(partial(Linear.forward, layer), layer.in_features, layer.weight.dtype,
                             padding)


@torch.inference_mode()
def kernel_rows_alike(run: Callable[[torch.Tensor], torch.Tensor], in_features: int,
                      dtype: torch.dtype, padding: RowPadding) -> bool:
    """Does `run` (x [rows, in_features] -> [rows, out]) give the first and last rows the same
    bits at every row count `padding` allows?"""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(PROBE_ROWS) + 4, in_features, generator=gen).to(dtype)
    counts = sorted({n + padding.pad(n) for n in PROBE_ROWS})
    base = counts[0]
    first = run(x[:base])[0]
    for n in counts[1:]:
        out = run(x[:n])
        # The first row among n rows and among `base`; the last row likewise, at the far end.
        if not (torch.equal(out[0], first) and torch.equal(out[-1], run(x[n - base : n])[-1])):
            return False
    return True


def pack_linears(model: nn.Module) -> RowPadding:
    """Pack every Linear on oneDNN if rows come out alike on all their shapes, else on the
    grouped kernel if it runs here and rows come out alike on it; return the rule followed.

    A packed layer's plain weight is then freed (unless another module shares it, as a tied
    embedding does), so a packed model takes no more memory than before.
    """
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if not layers:
        return MKL_ROWS
    for rule, pack in ((ONEDNN_ROWS, _pack_onednn), (KERNEL_ROWS, _pack_strips)):
        if pack(layers) and _rows_alike_on_every_shape(layers, rule):
            _free_plain_weights(model, layers)
            return rule
        for layer in layers:
            layer.packed = layer.strips = None
    return MKL_ROWS


def _pack_onednn(layers: list[Linear]) -> bool:
    if not onednn_available(layers[0].weight.device):
        return False
    try:
        for layer in layers:
            layer.pack()
    except RuntimeError:  # e.g. a dtype this CPU's oneDNN build does not run
        return False
    return True


def _pack_strips(layers: list[Linear]) -> bool:
    weight = layers[0].weight
    if weight.device.type != "cpu" or weight.dtype not in KERNELS:
        return False
    kernel = load_kernel()
    if kernel is None:
        return False
    for layer in layers:
        layer.strips = (kernel, pack_strips([layer.weight], [layer.bias]))
    return True


def _rows_alike_on_every_shape(layers: list[Linear], rule: RowPadding) -> bool:
    probed: dict[tuple, bool] = {}
    try:
        for layer in layers:
            shape = (layer.in_features, layer.out_features, layer.bias is not None)
            if shape not in probed:
                probed[shape] = rows_alike(layer, rule)
    except RuntimeError:  # a kernel that packed a dtype it then cannot run
        return False
    return all(probed.values())


def _free_plain_weights(model: nn.Module, layers: list[Linear]) -> None:
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    for layer in layers:
        if owners[id(layer.weight)] == 1:
            layer.weight.data = layer.weight.data.new_empty(0)
