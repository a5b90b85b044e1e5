"""Which kernel runs each op of a model, decided once at load: the one place that says it.

Two steps. `available()` probes the process once: which of our C libraries build, open and run
on this CPU (build.py; FREETOKEN_NO_KERNELS turns them all off), the quantized kernel's path
(FREETOKEN_QUANT_ISA caps it) and whether the whole-layer call may run (FREETOKEN_LAYER_KERNEL=0
keeps layers in Python). `plan_model` then walks a loaded model and asks each module that runs a
choosable op (`plan_kernels(kernels, dtype, device)`: the norms, the attention's rotation and its
reading of the KV pool, SwiGLU, the experts, the quantized layers (quant_gemm.c, or int8_gemm.c
where `--quantized-arithmetic int8` built them so), the whole-layer call) to settle
on its kernel for the model's dtype and device and name it; the module keeps its choice and reads
it on every step, so no step asks a library whether it runs or reads the environment. The linear
layers' choice, by probe and timing (layers/linear.py, kernel_choice.py; the bfloat16 units of
bf16_linear.c are among its candidates), comes in as a KernelPlan; the sampler's argmax
(`sampler_reductions`) is chosen by the device.

The plan is printed in one start-up line, served in `/v1/stats` (`engine.kernel_plan`) and in
`/metrics` (`freetoken:kernel_info{op, kernel}`).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field, replace
from functools import cache, cached_property

import torch
from torch import nn

from freetoken import envs
from freetoken.kernels import decoder_layer, grouped_gemm, pool_attention, quant

log = logging.getLogger(__name__)

# The ops every plan names (a model without one says "none").
OPS = ("linear", "quantized", "norm", "rotary", "swiglu", "attention", "moe_experts", "moe_route", "moe_sum",
       "layer", "sampler")
DTYPES = grouped_gemm.KERNELS  # the row dtypes our element-wise and attention kernels run


@dataclass(frozen=True)
class Available:
    """What this process can run: each library, or None where it cannot run here."""

    grouped: ctypes.CDLL | None  # grouped_gemm.c: grouped GEMM, norms, rotation, SwiGLU
    attention: ctypes.CDLL | None  # pool_attention.c
    quant_isa: int  # quant_gemm.c's path: 2 AVX-512, 1 AVX2, 0 none
    layer: ctypes.CDLL | None  # decoder_layer.c; None too under FREETOKEN_LAYER_KERNEL=0

    def elementwise(self, dtype: torch.dtype, device: torch.device | str) -> ctypes.CDLL | None:
        """grouped_gemm.c where rows of `dtype` on `device` run on it, else None (torch's ops)."""
        return self.grouped if torch.device(device).type == "cpu" and dtype in DTYPES else None


@cache
def available() -> Available:
    """Probed once per process (each library's loader logs why one cannot run)."""
    layer = decoder_layer.load() if envs.LAYER_KERNEL.get() != "0" else None
    return Available(grouped_gemm.load(), pool_attention.load(), quant.isa(), layer)


@dataclass(frozen=True)
class KernelPlan:
    """A model's kernels: whether every linear layer's rows are batch-invariant, the kernel and
    row rule per linear layer kind (`kernels`, layers/linear.py's pack_linears), and per op of
    OPS the kernel that runs it (`ops`, filled by `plan_model`)."""

    invariant: bool
    kernels: dict[str, str]
    ops: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        """The start-up log line: every op's kernel, the linear layers by kind."""
        claim = "batch-invariant" if self.invariant else "NOT batch-invariant"
        linears = "; ".join(f"{kind}: {kernel}" for kind, kernel in self.kernels.items()) or "none"
        ops = "; ".join(f"{op}: {self.ops.get(op, 'none')}" for op in OPS if op != "linear")
        return f"kernel plan ({claim}): {ops}; linear: {linears}"

    @cached_property
    def stats(self) -> dict[str, str]:
        """Op -> kernel, for /v1/stats and /metrics (linear: each kind's, joined); made once, as
        the engine sends it with every message."""
        linear = "; ".join(sorted(set(self.kernels.values()))) or "none"
        return {op: linear if op == "linear" else self.ops.get(op, "none") for op in OPS}


def sampler_reductions(device: torch.device | str) -> dict[str, str]:
    """The sampler's reductions over a step's logits (float32) on `device`: argmax by numpy's
    vectorised scan on the CPU, torch's elsewhere; logsumexp by torch, a lone row reduced as one
    of two (engine/sample.py: its bits then do not depend on the batch)."""
    return {"argmax": "numpy" if torch.device(device).type == "cpu" else "torch", "logsumexp": "torch"}


def plan_model(model: nn.Module, linears: KernelPlan, dtype: torch.dtype, device: torch.device | str,
               kernels: Available | None = None) -> KernelPlan:
    """`linears` with every op of `model` planned: each module with a `plan_kernels` method
    settles on its kernels (`kernels`: what may run, by default this process's) and names them;
    modules of one op that chose differently are listed together."""
    kernels = kernels or available()
    modules = [module for module in model.modules() if hasattr(module, "plan_kernels")]
    # A module's descendants settle first: the whole-layer call takes its layers' choices.
    plans = {id(module): module.plan_kernels(kernels, dtype, device) for module in reversed(modules)}
    chosen: dict[str, dict[str, None]] = {}
    for module in modules:
        for op, kernel in plans[id(module)].items():
            chosen.setdefault(op, {})[kernel] = None
    chosen["sampler"] = {", ".join(f"{name}: {how}" for name, how in sampler_reductions(device).items()): None}
    # Every op named: "none" where the model has no such module.
    ops = {op: " + ".join(chosen.get(op, {"none": None})) for op in OPS if op != "linear"}
    return replace(linears, ops={**linears.ops, **ops})


def log_plan(plan: KernelPlan, cpu: str) -> None:
    """The one start-up line (a warning where some shape's rows depend on their batch)."""
    log.log(logging.INFO if plan.invariant else logging.WARNING, "on %s, %s", cpu, plan.line())
