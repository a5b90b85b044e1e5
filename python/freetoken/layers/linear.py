"""Linear layers on the kernel the running CPU's probe chose for their shape (kernel_choice.py).

The candidates: "onednn", the weight packed once at load into oneDNN's blocked layout (on CPUs
with AMX or AVX512-BF16 its bfloat16 path runs on those units); "torch", `F.linear` as torch
dispatches it (MKL's sgemm for float32 on CPU, oneDNN for bfloat16, cuBLAS on CUDA); "grouped",
the grouped kernel of grouped_gemm.c as one group each (float32 sums, bfloat16 weights widened
as they are read; invariant by construction, and probed like the others all the same); "amx" and
"avx512_bf16", bfloat16 on AMX tiles or AVX512-BF16 dot products (bf16_linear.c, invariant by
construction too).
FREETOKEN_LINEAR_KERNEL=<name> restricts the choice to one of them (benchmarks, tests).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from functools import cache, partial

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.config import LINEAR_KERNELS
from freetoken.kernels import bf16_linear
from freetoken.kernels.bf16_linear import pack_pairs, unit_linear, unpack_columns
from freetoken.kernels.grouped_gemm import KERNELS, grouped_gemm
from freetoken.kernels.grouped_gemm import load as load_kernel
from freetoken.kernels.grouped_gemm import pack as pack_strips
from freetoken.kernels.plan import KernelPlan
from freetoken.layers.kernel_choice import (RULE_TIE, UNCAPPED, Measured, Run, RowRule, measure,
                                            measured_with_cache, probe_weight, ranked, run_by_rule)


CANDIDATES = LINEAR_KERNELS  # config.py names them: a flag's choices, read without loading torch
# Our kernels give a row the same operations in the same order at any row count (grouped_gemm.c):
# where the probe confirms it, their calls take a step's rows whole, and a decode step's few rows
# unpadded (they run short tiles: padding them never pays, whatever a busy machine's timing said).
INVARIANT_BY_CONSTRUCTION = ("grouped", *bf16_linear.UNITS)
LAYER_INDEX = re.compile(r"\.\d+\.")  # model.layers.3.mlp -> model.layers.*.mlp in the plan


class Linear(nn.Linear):
    """`nn.Linear` (same parameter names, so state dicts load) that runs on a chosen kernel."""

    # Plain attributes, read without nn.Module's parameter lookup.
    run: Run | None = None
    rule: RowRule = RowRule()
    # Set where the caller runs the layer inside one of our C calls, which take our kernels alone
    # (the MoE router: kernels/decoder_layer.c's sparse layer): ours wins whatever its time.
    wants_ours: bool = False
    _subsets: dict[tuple[int, ...], Run] | None = None  # logits_at's kernels, by columns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.run is None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if rows < self.rule.minimum:  # a decode step's few rows: the zeros cost less than a GEMV
            flat = F.pad(flat, (0, 0, 0, self.rule.pad(rows)))
        return run_by_rule(self.run, self.rule, flat)[:rows].view(*x.shape[:-1], self.out_features)

    def logits_at(self, x: torch.Tensor, columns: list[int]) -> torch.Tensor | None:
        """x [rows, in] through the layer at output `columns` only (sorted ids), as float32
        [rows, len(columns)]: each of those outputs with the bits `forward` gives it (an LM head
        whose rows' masks allow those ids alone; the sampler takes every other logit as -inf).
        None where the kernel does not promise those bits on a subset of its weights: ours only,
        whose each output is its own sum, whatever the outputs beside it."""
        if self.run is None or (self.rule.minimum, self.rule.most) != (1, UNCAPPED):
            return None
        key = tuple(columns)
        subset = self._subsets.get(key) if self._subsets is not None else None
        if subset is None:
            if (subset := subset_run(self.run, columns)) is None:
                return None
            if self._subsets is None or len(self._subsets) >= 8:  # a few label sets at a time
                self._subsets = {}
            self._subsets[key] = subset
        return subset(x).float()


def may_run(kernel: str, layer: Linear) -> bool:
    """Can `kernel` run `layer`'s dtype and device here, as far as a check short of packing its
    weights tells (oneDNN finds out which dtypes it runs only when asked to pack one)?"""
    weight = layer.weight
    if kernel == "torch":
        return True
    if weight.device.type != "cpu":
        return False
    if kernel == "onednn":
        return torch.backends.mkldnn.is_available()
    if kernel == "grouped":
        return weight.dtype in KERNELS and load_kernel() is not None
    return (kernel in bf16_linear.UNITS and weight.dtype == torch.bfloat16 and layer.in_features % 32 == 0
            and bf16_linear.available(kernel))


def prepare(kernel: str, layer: Linear) -> Run | None:
    """`layer` on `kernel`, or None where that kernel cannot run its dtype and device here."""
    if not may_run(kernel, layer):
        return None
    weight, bias = layer.weight.detach(), layer.bias
    if kernel == "torch":
        return partial(_f_linear, weight, bias)
    if kernel == "onednn":
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        except RuntimeError:  # a dtype this CPU's oneDNN build does not run
            return None
        return partial(_onednn, packed, bias)
    if kernel == "grouped":
        return partial(grouped_gemm, load_kernel(), experts=pack_strips([weight], [bias]))
    return partial(unit_linear, kernel, pack_pairs(weight), None if bias is None else bias.float(),
                   layer.out_features)


def subset_run(run: Run, columns: list[int]) -> Run | None:
    """`run` (a layer on one of our kernels) on the weights of output `columns` alone,
    taken back out of its packed layout (the plain weights may be freed); None for another
    kernel."""
    func, ids = getattr(run, "func", None), torch.tensor(columns)
    if func is unit_linear:
        unit, packed, bias, _ = run.args
        return partial(unit_linear, unit, pack_pairs(unpack_columns(packed, ids)),
                       None if bias is None else bias[ids], len(columns))
    if func is grouped_gemm:
        experts = run.keywords["experts"]
        weight = experts.weight[0, ids // 16, :, ids % 16]  # pack's [1, N/16, K, 16]
        bias = None if experts.bias is None else experts.bias[0, ids]
        return partial(grouped_gemm, run.args[0], experts=pack_strips([weight], [bias]))
    return None


def _f_linear(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _onednn(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# The kernels the load in progress may choose among (`only_kernel`): a load's choice, read by the
# probes of its layers and of their parts (distributed/parts.py) without a parameter threaded
# through every layer built in between.
_ALLOWED: ContextVar[tuple[str, ...]] = ContextVar("linear_kernels", default=CANDIDATES)


# A server whose logit rows read a few chosen ids or none (--runner pooling: a reranker's two
# labels, an embedder's none) wants its LM head on a kernel that computes those columns alone
# (Linear.logits_at): one of ours, whatever the vocabulary-wide timings say of oneDNN.
_HEAD_FOR_COLUMNS: ContextVar[bool] = ContextVar("head_for_columns", default=False)


@contextmanager
def only_kernel(kernel: str | None):
    """Within it, the probes choose `kernel` alone (None: any of CANDIDATES)."""
    token = _ALLOWED.set((kernel,) if kernel else CANDIDATES)
    try:
        yield
    finally:
        _ALLOWED.reset(token)


@contextmanager
def head_for_columns(wanted: bool):
    """Within it, with `wanted`, the LM head is packed on a kernel that computes chosen columns
    alone, where one runs here and is batch-invariant."""
    token = _HEAD_FOR_COLUMNS.set(wanted)
    try:
        yield
    finally:
        _HEAD_FOR_COLUMNS.reset(token)


def candidates() -> tuple[str, ...]:
    return _ALLOWED.get()


def choose(layer: Linear, ours: bool = False) -> tuple[Measured, bool, Run] | None:
    """The kernel for `layer`'s shape among `candidates()`: its measurement, whether it is
    batch-invariant, and `layer` prepared on it; None where none can run. One of ours
    (INVARIANT_BY_CONSTRUCTION) whose rule holds wins a tie, timed within RULE_TIE of the fastest:
    it takes a step's rows whole and unpadded where oneDNN's rule may pad a decode step's row to
    16 (the 30B-A3B shape's router: 124.8 against 128.5 us probed, the batch-1 step 5 % faster on
    ours). With `ours` (outputs computed apart: Linear.logits_at; a layer run inside one of our C
    calls: Linear.wants_ours) ours wins whatever its time."""
    weight = layer.weight
    key = (f"{weight.dtype} {weight.device.type} {layer.in_features}x{layer.out_features}"
           f"{' bias' if layer.bias is not None else ''}")
    probe_layer = cache(partial(_probe_layer, layer))  # a layer's size: built on a cache miss only
    names = [name for name in candidates() if may_run(name, layer)]

    def probe() -> list[Measured]:
        runs = {name: run for name in names if (run := prepare(name, probe_layer())) is not None}
        return measure(runs, layer.in_features, weight.dtype, weight.device) if runs else []

    measured = ranked(measured_with_cache(f"{key} {','.join(names)}", probe) if names else [])
    fastest = measured[0].seconds if measured else 0.0
    measured.sort(key=lambda m: not (m.rule is not None and m.kernel in INVARIANT_BY_CONSTRUCTION
                                     and (ours or m.seconds <= fastest * (1 + RULE_TIE))))
    for best in measured:
        if (run := prepare(best.kernel, layer)) is not None:
            if best.rule is not None and best.kernel in INVARIANT_BY_CONSTRUCTION:
                best = replace(best, rule=RowRule(1, UNCAPPED))
            return best, best.rule is not None, run
    return None


def _probe_layer(layer: Linear) -> Linear:
    """A layer of `layer`'s shape, dtype and device on `probe_weight`'s weights."""
    weight = layer.weight
    probe = Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                   device=weight.device, dtype=weight.dtype).requires_grad_(False)
    probe.weight.copy_(probe_weight(layer.out_features, layer.in_features, weight.dtype))
    if layer.bias is not None:
        probe.bias.normal_()
    return probe


def pack_linears(model: nn.Module) -> KernelPlan:
    """Put every Linear of `model` on the kernel chosen for its shape, free the plain weights
    those kernels copied (unless another module shares them, as a tied embedding does); the
    plan (its linear layers', which kernels/plan.py's plan_model completes) is kept as
    `model.kernel_plan` too."""
    by_shape: dict[tuple, list[tuple[str, Linear]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            w = module.weight
            shape = (module.in_features, module.out_features, module.bias is not None, w.dtype, w.device)
            by_shape.setdefault(shape, []).append((name, module))
    invariant, kernels = True, {}
    for members in by_shape.values():
        first = members[0][1]
        kind = f"{LAYER_INDEX.sub('.*.', members[0][0])} {first.in_features}x{first.out_features}"
        chosen = choose(first, ours=any(layer.wants_ours or (_HEAD_FOR_COLUMNS.get() and name == "lm_head")
                                        for name, layer in members))
        if chosen is None:  # no candidate runs this dtype here (a forced one, say): unprobed
            invariant, kernels[kind] = False, "F.linear (not probed)"
            continue
        best, shape_invariant, run = chosen
        rule = best.rule or RowRule()
        for _, layer in members:
            layer.run, layer.rule = (run if layer is first else prepare(best.kernel, layer)), rule
        if best.kernel != "torch":
            _free_plain_weights(model, [layer for _, layer in members])
        invariant = invariant and shape_invariant
        rows = "any" if rule.most == UNCAPPED else f"{rule.minimum}-{rule.most}"
        kernels[kind] = f"{best.kernel} (rows {rows})" if best.rule else f"{best.kernel} (not invariant)"
    model.kernel_plan = plan = KernelPlan(invariant, kernels)
    return plan


def _free_plain_weights(model: nn.Module, layers: list[Linear]) -> None:
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    for layer in layers:
        if owners[id(layer.weight)] == 1:
            layer.weight.data = layer.weight.data.new_empty(0)
