"""Layers whose weights stay in GGUF's block formats (kernels/quant.py): a linear layer
and an embedding, and putting them in place of a loaded module's plain ones.

A fused projection (q/k/v, gate/up) is its parts' rows one after the other, and a GGUF stores
each part apart, possibly in different formats (Q4_K_M keeps v in Q6_K, q and k in Q4_K): the
layer keeps the parts as stored, each run by its own matmul straight into its columns of the
output, rather than copying them into one weight.

The arithmetic (`--quantized-arithmetic`) is chosen as the layers are made, inside
kernels/int8.py's `arithmetic()`: "int8" runs a layer whose parts are all in that kernel's
formats on it, the others (and "exact") on quant.py's.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from freetoken.kernels import int8
from freetoken.kernels.plan import Available, KernelPlan
from freetoken.kernels.quant import ISAS, QuantizedWeight, QuantParts, dequantize_rows, quant_linear_parts, supported
from freetoken.layers.linear import LAYER_INDEX
from freetoken.layers.moe import Experts

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 3, 16)  # row counts checked against the rows of a 64-row product
Part = QuantizedWeight | torch.Tensor  # a tensor: a part dequantized at load (no kernel for it)


def fused_run(parts: list[Part], biases: list[torch.Tensor | None]) -> QuantParts | int8.Int8Parts | None:
    """Every part on one kernel call (the arithmetic's; int8 where it takes every part), or None."""
    if not all(isinstance(p, QuantizedWeight) and supported(p.qtype) for p in parts):
        return None
    if int8.chosen(parts):
        return int8.Int8Parts(parts, biases)
    return QuantParts(parts, biases)


class QuantizedLinear(nn.Module):
    """y = x @ [part0; part1; ...]^T + bias, each part a QuantizedWeight (or a float weight)."""

    def __init__(self, parts: list[Part], bias: torch.Tensor | None):
        super().__init__()
        self.parts = parts
        self.in_features = parts[0].shape[-1]
        sizes = [p.shape[0] for p in parts]
        self.out_features = sum(sizes)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.part_bias = [None] * len(parts) if bias is None else list(bias.split(sizes))
        # Every part on the kernel: one call for them all, its arguments made here once.
        self.fused = fused_run(parts, self.part_bias)

    def plan_kernels(self, kernels: Available, dtype: torch.dtype, device: torch.device | str) -> dict[str, str]:
        """kernels/plan.py's question (answered when the layer was built: `fused`, on the int8
        arithmetic's kernel or the exact one)."""
        if isinstance(self.fused, int8.Int8Parts):
            return {"quantized": int8.kernel_name(self.fused.path)}
        isa = {code: name for name, code in ISAS.items()}.get(kernels.quant_isa)
        return {"quantized": f"quant_gemm.c ({isa})" if self.fused else "quant_linear (a part on F.linear)"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = self.fused(flat) if self.fused else quant_linear_parts(flat, self.parts, self.part_bias)
        return y.view(*x.shape[:-1], self.out_features)

    def logits_at(self, x: torch.Tensor, columns: list[int]) -> torch.Tensor | None:
        """`Linear.logits_at` on the blocks: either kernel computes each output on its own
        (quant_gemm.c, int8_gemm.c), so the weight's rows at `columns` give those outputs the
        whole layer's bits. None for a layer of several parts or one dequantized at load (a head
        has neither)."""
        if self.fused is None or len(self.parts) != 1:
            return None
        weight, ids = self.parts[0], torch.tensor(columns)
        subset = QuantizedWeight(weight.qtype, weight.data.index_select(0, ids), (len(columns), self.in_features))
        bias = None if self.bias is None else self.bias.index_select(0, ids)
        return type(self.fused)([subset], [bias])(x.reshape(-1, self.in_features)).float()


class QuantizedEmbedding(nn.Module):
    """An embedding lookup that dequantizes the rows it is asked for."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.weight, self.dtype = weight, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.weight, ids.reshape(-1)).to(self.dtype).view(*ids.shape, -1)


def take_quantized(state: dict[str, Part], fused: dict[str, tuple[str, ...]]) -> dict[str, list[Part]]:
    """Out of `state` (HF names), every weight of a module one of whose parts is quantized: our
    module name -> its parts in row order (`fused`: our fused module -> its HF parts). Biases
    stay in `state`."""
    part_of = {part: (target, i) for target, parts in fused.items() for i, part in enumerate(parts)}
    members: dict[str, list[tuple[int, str]]] = {}
    for name in state:
        module, _, leaf = name.rpartition(".")
        if leaf != "weight":
            continue
        prefix, _, last = module.rpartition(".")
        target, index = part_of.get(last, (last, 0))
        members.setdefault(f"{prefix}.{target}" if prefix else target, []).append((index, name))
    return {module: [state.pop(name) for _, name in sorted(names)]
            for module, names in members.items()
            if any(isinstance(state[name], QuantizedWeight) for _, name in names)}


def install(model: nn.Module, quantized: dict[str, list[Part]], dtype: torch.dtype) -> None:
    """Put the quantized layers in place of `model`'s modules of those names (a Linear keeps the
    bias the loader gave it; an Embedding becomes a QuantizedEmbedding)."""
    for name, parts in quantized.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        if isinstance(old, nn.Embedding):
            setattr(parent, child, QuantizedEmbedding(parts[0], dtype))
        else:
            bias = None if old.bias is None or old.bias.is_meta else old.bias.detach()
            setattr(parent, child, QuantizedLinear([p if isinstance(p, QuantizedWeight) else p.to(dtype)
                                                    for p in parts], bias))


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """The bytes of `model`'s weights by format (a block format's name, or a torch dtype's),
    each shared weight counted once."""
    seen: set[int] = set()
    sizes: dict[str, int] = {}

    def add(key: str, tensor: torch.Tensor, nbytes: int) -> None:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            sizes[key] = sizes.get(key, 0) + nbytes

    for module in model.modules():
        if isinstance(module, Experts) and module.quantized is not None:
            for weight in module.quantized.weights:
                add(weight.qtype.name, weight.data, weight.nbytes)
            for bias in (module.quantized.gate_up_bias, module.quantized.down_bias):
                if bias is not None:
                    add(str(bias.dtype).removeprefix("torch."), bias, bias.nbytes)
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            for part in module.parts if isinstance(module, QuantizedLinear) else [module.weight]:
                if isinstance(part, QuantizedWeight):
                    add(part.qtype.name, part.data, part.nbytes)
                else:
                    add(str(part.dtype).removeprefix("torch."), part, part.nbytes)
        for param in module.parameters(recurse=False):
            add(str(param.dtype).removeprefix("torch."), param, param.nbytes)
    return sizes


def plan_quantized(model: nn.Module, plan: KernelPlan, dtype: torch.dtype) -> KernelPlan:
    """`plan` (pack_linears') with `model`'s quantized layers added, by kind (their formats, and
    int8_linear where they run the int8 arithmetic), batch-invariant where each format's rows come
    out alike at every row count on its kernel (probed once per format and kernel on the smallest
    weight of that format) and no part runs F.linear."""
    kinds: dict[str, str] = {}
    probes: dict[tuple[str, type], QuantizedWeight] = {}
    widened = False
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedLinear):
            continue
        formats = []
        run = type(module.fused) if module.fused is not None else QuantParts
        for part in module.parts:
            if isinstance(part, QuantizedWeight):
                formats.append(part.qtype.name)
                key = (part.qtype.name, run)
                if key not in probes or part.nbytes < probes[key].nbytes:
                    probes[key] = part
            else:
                formats.append(f"{str(part.dtype).removeprefix('torch.')} (F.linear)")
                widened = True
        kinds[f"{LAYER_INDEX.sub('.*.', name)} {module.in_features}x{module.out_features}"] = \
            f"{getattr(run, 'name', 'quant_linear')} {'+'.join(dict.fromkeys(formats))}"
    if not kinds:
        return plan
    alike = {qtype: _rows_alike(weight, run, dtype) for (qtype, run), weight in probes.items()}
    invariant = all(alike.values()) and not widened
    # The kinds go into the plan's start-up line (kernels/plan.py); the per-format verdict here.
    log.log(logging.DEBUG if invariant else logging.WARNING, "quantized layers: %s; rows alike at "
            "every row count: %s", "; ".join(f"{k}: {v}" for k, v in kinds.items()),
            ", ".join(f"{q} {'yes' if ok else 'NO'}" for q, ok in alike.items()))
    return KernelPlan(plan.invariant and invariant, {**plan.kernels, **kinds})


def _rows_alike(weight: QuantizedWeight, run: type, dtype: torch.dtype) -> bool:
    x = torch.randn(64, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(dtype)
    product = run([weight], [None])
    full = product(x)
    return all(torch.equal(product(x[:rows]), full[:rows]) for rows in PROBE_ROWS)
