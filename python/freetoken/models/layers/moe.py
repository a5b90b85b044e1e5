"""Mixture-of-experts execution grouped by expert, batch-invariant like the dense layers.

A step's (token, expert) assignments are sorted by expert id, and the gathered rows run through
each active expert's projections. On CPU (float32 or bfloat16) that is the grouped kernel of
grouped_gemm.c, one call per projection for all experts, whose rows never depend on their
group. Elsewhere each active expert runs its `Linear`s over its rows (the kernel each expert
shape runs on, and its row rule, are chosen at load by `pack_linears` as for the dense layers).
The weighted outputs are then added into their tokens' rows in ascending expert id
(`index_add_` adds in row order), the order transformers' reference loop adds them in: a
token's sum runs in that fixed order, so a row's result does not depend on which other rows
shared its experts.

The family supplies the router (which experts, with which weights) and the activation between
an expert's fused gate/up projection and its down projection; `SparseMoeBlock` is the Qwen MoE
families' (Qwen3-MoE, Qwen2-MoE, the Qwen3.5 / Qwen3-Next hybrids).
"""

from __future__ import annotations

import ctypes
from functools import partial
from typing import Callable

import torch
from torch import nn

from freetoken.models.kernels.grouped_gemm import KERNELS, PackedLinears, grouped_gemm, pack
from freetoken.models.kernels.grouped_gemm import load as load_kernel
from freetoken.models.layers.kernel_choice import RowRule, probe_weight, rule_holds
from freetoken.models.layers.elementwise import lanewise, silu_and_mul
from freetoken.models.layers.linear import Linear
from freetoken.models.layers.mlp import MLP

Activation = Callable[[torch.Tensor], torch.Tensor]


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-MoE routing: softmax over all experts in fp32, the k largest, optionally renormalised
    to sum to 1 (`norm_topk_prob`). Returns (weights [T, k] fp32, expert ids [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Expert(nn.Module):
    """One expert: fused gate/up projection, activation, down projection."""

    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)


class Experts(nn.Module):
    """`num_experts` experts (`experts.{e}.gate_up_proj`, `experts.{e}.down_proj`) run grouped."""

    # Set by models/layers/tensor_parallel.py when each expert holds one rank's slice: the sum of the
    # ranks' partial outputs.
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Set by `stack`: the experts' projections in the grouped kernel's layout, and the kernel.
    stacked: tuple[PackedLinears, tuple[PackedLinears, ...]] | None = None  # gate/up, down's parts
    kernel: ctypes.CDLL | None = None
    # Set by models/layers/parts.py where one process computes what tensor-parallel ranks would:
    # the down projection's input columns per part, each part's weighted sum added in part order.
    down_parts: tuple[slice, ...] = (slice(None),)

    def __init__(self, num_experts: int, hidden: int, intermediate: int, bias: bool,
                 activation: Activation):
        super().__init__()
        self.num_experts = num_experts
        self.experts = nn.ModuleList(Expert(hidden, intermediate, bias) for _ in range(num_experts))
        self.activation = activation

    def stack(self, kernel: ctypes.CDLL) -> None:
        """Run on the grouped kernel from now on: its packed weights replace the Linears."""
        packed = {}
        for name in ("gate_up_proj", "down_proj"):
            layers = [getattr(expert, name) for expert in self.experts]
            packed[name] = pack([layer.weight for layer in layers], [layer.bias for layer in layers])
        self.stacked, self.kernel = (packed["gate_up_proj"], (packed["down_proj"],)), kernel
        self.experts = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; ids [T, k] expert of each of a token's k slots; weights [T, k]."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        by_expert = torch.argsort(flat, stable=True)
        tokens = by_expert // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        project = self._on_kernel if self.stacked else self._on_linears
        hidden = self.activation(project(counts, x.index_select(0, tokens), "gate_up_proj"))
        scale = weights.reshape(-1, 1).index_select(0, by_expert).to(x.dtype)
        out = None
        for part, cols in enumerate(self.down_parts):
            down = project(counts, hidden[:, cols].contiguous(), "down_proj", part).mul_(scale)
            # Rows are in ascending expert id, and index_add_ adds them in row order: each
            # token's sum runs over its experts in that fixed order.
            summed = torch.zeros_like(x).index_add_(0, tokens, down)
            out = summed if out is None else out.add_(summed)
        return out if self.sum_over_ranks is None else self.sum_over_ranks(out)

    def _on_kernel(self, counts: list[int], rows: torch.Tensor, name: str, part: int = 0) -> torch.Tensor:
        """Projection `name` (of the down projection, its part `part`) as one kernel call over
        rows grouped by expert (no padding: the kernel's rows never depend on their group)."""
        groups, first = [], 0
        for e, n in enumerate(counts):
            if n:
                groups.append((e, first, n))
                first += n
        gate_up, downs = self.stacked
        packed = gate_up if name == "gate_up_proj" else downs[part]
        return grouped_gemm(self.kernel, rows, packed, torch.tensor(groups, dtype=torch.int64))

    def _on_linears(self, counts: list[int], rows: torch.Tensor, name: str, part: int = 0) -> torch.Tensor:
        """Each active expert's layer `name` (of a down projection in parts, its part `part`)
        over its run of `rows` (each Linear keeps its own row rule)."""
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                layer = getattr(self.experts[e], name)
                layer = layer.parts[part] if hasattr(layer, "parts") else layer  # parts.RowParts
                outs.append(layer(rows[start : start + n]))
                start += n
        return torch.cat(outs)


class SparseMoeBlock(Experts):
    """The router (`gate`) and the experts of one layer, named as transformers names them; with
    `shared_intermediate`, also a shared expert every token goes through, scaled by
    sigmoid(shared_expert_gate)."""

    def __init__(self, hidden: int, num_experts: int, intermediate: int, top_k: int,
                 norm_topk_prob: bool, shared_intermediate: int = 0):
        super().__init__(num_experts, hidden, intermediate, bias=False, activation=silu_and_mul)
        self.gate = Linear(hidden, num_experts, bias=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        if shared_intermediate:
            self.shared_expert = MLP(hidden, shared_intermediate)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x), self.top_k, self.norm_topk_prob)
        routed = super().forward(x, ids, weights)
        if not hasattr(self, "shared_expert"):
            return routed
        # One gate per token ([T, 1]): lanewise, or a token's gate would depend on T.
        return routed + lanewise(torch.sigmoid, self.shared_expert_gate(x)) * self.shared_expert(x)


def stack_experts(model: nn.Module) -> None:
    """Put every CPU Experts of `model` on the grouped kernel, where it runs here and a row's
    bits come out the same at every row count on the experts' own shapes (checked, as the
    dense layers' are; otherwise they stay on packed Linears)."""
    layers = [m for m in model.modules() if isinstance(m, Experts)]
    weight = layers[0].experts[0].down_proj.weight if layers else None
    if weight is None or weight.dtype not in KERNELS or weight.device.type != "cpu":
        return
    kernel = load_kernel()
    if kernel is None:
        return
    for name in ("gate_up_proj", "down_proj"):
        probe = getattr(layers[0].experts[0], name)
        packed = pack([probe_weight(probe.out_features, probe.in_features, probe.weight.dtype)],
                      [probe.bias])
        run = partial(grouped_gemm, kernel, experts=packed)
        if not rule_holds(run, probe.in_features, probe.weight.dtype, RowRule()):
            return
    for layer in layers:
        layer.stack(kernel)


def split_stacked_experts(state: dict[str, torch.Tensor], name: str, transpose: bool = False,
                          target: str | None = None) -> dict[str, torch.Tensor]:
    """Turn a stacked expert tensor `...experts.<name>` ([E, out, in], or [E, in, out] with
    `transpose`) into per-expert `...experts.<e>.<target or name>.weight` entries; a stacked bias
    `...experts.<name>_bias` ([E, out]) into `....bias`. Other entries pass through."""
    result = {}
    for key, value in state.items():
        prefix, dot, leaf = key.rpartition("experts.")
        base = leaf.removesuffix("_bias")
        if not dot or base != name:
            result[key] = value
            continue
        kind = "bias" if leaf.endswith("_bias") else "weight"
        for e, tensor in enumerate(value.unbind(0)):
            if kind == "weight" and transpose:
                tensor = tensor.T
            result[f"{prefix}experts.{e}.{target or name}.{kind}"] = tensor.contiguous()
    return result
