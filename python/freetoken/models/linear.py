"""Linear layers on oneDNN with weights packed once at load.

torch's CPU `F.linear` goes through MKL, which on this machine's AMD cores runs 2-3x below
what oneDNN reaches on the same shapes (small M worst: decode rows are 1-32). oneDNN also gives
a row the same bits whatever the number of rows M, except for M = 1, which takes a GEMV kernel
that splits the reduction; the engine therefore never runs fewer than two rows
(`engine.MIN_ROWS`). Elsewhere (CUDA, torch built without oneDNN) layers use `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def onednn_available(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


class Linear(nn.Linear):
    """`nn.Linear` (same parameter names, so state dicts load) that runs packed when asked."""

    # (oneDNN weight, bias): a plain attribute, read without nn.Module's parameter lookup.
    packed: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def pack(self, drop_weight: bool) -> None:
        """Reorder the weight into oneDNN's blocked layout; call after the final dtype cast.

        `drop_weight` frees the plain copy, which nothing reads afterwards unless another module
        shares it (a tied embedding), so a packed model takes no more memory than before.
        """
        if not onednn_available(self.weight.device):
            return
        weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.packed = (weight, self.bias)
        if drop_weight:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        weight, bias = self.packed
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_linears(model: nn.Module) -> None:
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(drop_weight=owners[id(module.weight)] == 1)
