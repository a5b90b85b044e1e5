"""Mixture-of-experts execution grouped by expert, batch-invariant like the dense layers.

A step's (token, expert) assignments are sorted by expert id, and the gathered rows run through
each active expert's projections. On CPU (float32 or bfloat16) that is the grouped kernel of
grouped_gemm.c, one call per projection for all experts, whose rows never depend on their
group; experts kept quantized (a GGUF file's, gpt-oss's MXFP4) run the same way through
kernels/quant.py's `grouped_quant_gemm` (kernels/int8.py's `grouped_int8_gemm` under
`--quantized-arithmetic int8`). Elsewhere each active expert runs its `Linear`s
over its rows (the kernel each expert shape runs on, and its row rule, are chosen at load by
`pack_linears` as for the dense layers).
The weighted outputs are then added into their tokens' rows in ascending expert id (in float32,
rounded once), the order transformers' reference loop adds them in: a token's sum runs in that
fixed order, so a row's result does not depend on which other rows shared its experts.

The family supplies the router (which experts, with which weights) and the activation between
an expert's fused gate/up projection and its down projection; `SparseMoeBlock` is the Qwen MoE
families' (Qwen3-MoE, Qwen2-MoE, the Qwen3.5 / Qwen3-Next hybrids).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

from freetoken.kernels.grouped_gemm import KERNELS, ROUTES, PackedLinears, grouped_gemm, moe_route, moe_sum, pack
from freetoken.kernels import decoder_layer, int8
from freetoken.kernels.int8 import grouped_int8_gemm
from freetoken.kernels.plan import Available, available
from freetoken.kernels.quant import QuantizedWeight, dequantize, grouped_quant_gemm, supported
from freetoken.layers.kernel_choice import RowRule, probe_weight, rule_holds
from freetoken.layers.elementwise import clamped_swiglu, lanewise, silu_and_mul
from freetoken.layers.linear import Linear
from freetoken.layers.mlp import MLP, swiglu_name
from freetoken.layers.skeleton import on_meta

log = logging.getLogger(__name__)

Activation = Callable[[torch.Tensor], torch.Tensor]
# The activations kernels/decoder_layer.c's sparse MLP computes (struct moe's `activation`).
GATED_ACTIVATIONS = (silu_and_mul, clamped_swiglu)


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


@dataclass(frozen=True)
class QuantizedExperts:
    """A layer's experts kept quantized: gate_up's parts along the rows ([E, n, H] each; together
    each expert's I gate rows, then its I up rows), down [E, H, I], biases float32 [E, 2I] and
    [E, H] or None."""

    gate_up: tuple[QuantizedWeight, ...]
    down: QuantizedWeight
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    # Set by distributed/parts.py: down's parts of K (whole blocks), one per Experts.down_parts,
    # each computed as a tensor-parallel rank computes its own (all in one kernel call).
    down_cuts: tuple[range, ...] = ()
    # kernels/int8.py's path where they run its arithmetic (`--quantized-arithmetic int8`), else None.
    int8_path: int | None = None

    @property
    def weights(self) -> tuple[QuantizedWeight, ...]:
        return (*self.gate_up, self.down)

    @property
    def nbytes(self) -> int:
        biases = [b.numel() * b.element_size() for b in (self.gate_up_bias, self.down_bias) if b is not None]
        return sum(w.nbytes for w in self.weights) + sum(biases)


class Experts(nn.Module):
    """`num_experts` experts (`experts.{e}.gate_up_proj`, `experts.{e}.down_proj`) run grouped."""

    # Set by distributed/tensor_parallel.py when each expert holds one rank's slice: the sum of the
    # ranks' partial outputs.
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Set by `stack`: the experts' projections in the grouped kernel's layout, and the kernel.
    stacked: tuple[PackedLinears, tuple[PackedLinears, ...]] | None = None  # gate/up, down's parts
    kernel: ctypes.CDLL | None = None
    # Set by `plan_kernels`: grouped_gemm.c (moe_sum_f32) where float32 rows run on it, else None
    # (torch's ops); unplanned (a test's module): this process's.
    sum_kernel: ctypes.CDLL | None = NotImplemented
    # Set by `use_quantized`.
    quantized: QuantizedExperts | None = None
    # A family routed by moe_route_f32 (Qwen-MoE, gpt-oss): its router's attribute name and its
    # mode (grouped_gemm.ROUTES); the route kernel set by `plan_kernels` (None: off the CPU or
    # another family; unplanned: this process's).
    router_name: str | None = None
    route_mode: int | None = None
    route_kernel: ctypes.CDLL | None = NotImplemented
    # Set by distributed/parts.py where one process computes what tensor-parallel ranks would:
    # the down projection's input columns per part, each part's weighted sum added in part order
    # (quantized experts: QuantizedExperts.down_cuts).
    down_parts: tuple[slice, ...] = (slice(None),)

    def __init__(self, num_experts: int, hidden: int, intermediate: int, bias: bool,
                 activation: Activation):
        super().__init__()
        self.num_experts = num_experts
        self.experts = nn.ModuleList(Expert(hidden, intermediate, bias) for _ in range(num_experts))
        self.activation = activation

    def plan_kernels(self, kernels: Available, dtype: torch.dtype, device: torch.device | str) -> dict[str, str]:
        """kernels/plan.py's question: the experts' kernel (`stack_experts` and the GGUF loader
        chose it) and SwiGLU's, where the activation is plain SwiGLU."""
        q = self.quantized
        experts = (("quant_gemm.c" if q.int8_path is None else int8.kernel_name(q.int8_path)) if q is not None
                   else "grouped_gemm.c" if self.stacked else "torch (a Linear per expert)")
        lib = kernels.elementwise(dtype, device)
        self.sum_kernel = lib if dtype == torch.float32 else None
        plan = {"moe_experts": experts, "moe_sum": "grouped_gemm.c moe_sum_f32" if self.sum_kernel else "torch"}
        activation = getattr(self.activation, "func", self.activation)
        if activation is silu_and_mul:
            self.activation = partial(silu_and_mul, lib=lib)
            plan["swiglu"] = swiglu_name(lib, dtype)
        elif activation is clamped_swiglu:
            lib = lib if dtype == torch.float32 else None
            self.activation = partial(self.activation, lib=lib)
            plan["swiglu"] = "grouped_gemm.c clamped_swiglu_f32" if lib else "torch gpt-oss SwiGLU (lanewise)"
        if self.router_name is not None:
            self.route_kernel = kernels.grouped if torch.device(device).type == "cpu" else None
            plan["moe_route"] = "grouped_gemm.c moe_route_f32" if self.route_kernel else "torch"
        return plan

    def routed(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A CPU step's route (weights, ids) on moe_route_f32, the one kernels/decoder_layer.c's
        call runs, so a layer gives the same bits on either path; its torch formula where the
        kernel does not run here."""
        lib = available().grouped if self.route_kernel is NotImplemented else self.route_kernel
        if lib is None or logits.device.type != "cpu":
            return self.torch_route(logits)
        return moe_route(lib, logits, self.top_k, self.route_mode)

    def torch_route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def one_call(self, run_of: Callable[[nn.Module], object]) -> decoder_layer.Moe | None:
        """This block's arguments for kernels/decoder_layer.c's call (`run_of`: what the call runs
        for a linear layer, None: none), or None where it runs in Python: a family the route
        kernel does not route, a shared expert, an activation other than SwiGLU or gpt-oss's on
        grouped_gemm.c, experts neither packed on the grouped kernel nor kept quantized, or a
        tensor-parallel layout but quantized experts' K parts (a rank's sum, float experts'
        down projection in parts)."""
        activation = getattr(self.activation, "func", None)
        lib = getattr(self.activation, "keywords", {}).get("lib")
        if (self.router_name is None or hasattr(self, "shared_expert") or self.sum_over_ranks is not None
                or self.down_parts != (slice(None),) or lib is None or self.route_kernel is None
                or self.sum_kernel is None or activation not in GATED_ACTIVATIONS):
            return None
        router, q = run_of(getattr(self, self.router_name)), self.quantized
        if q is not None:
            gate_up, down, biases = q.gate_up, q.down, (q.gate_up_bias, q.down_bias)
        elif self.stacked is not None:
            packed_gate_up, (down,) = self.stacked
            gate_up, biases = (packed_gate_up,), (None, None)
        else:
            return None
        clamp = self.activation.keywords.get("alpha"), self.activation.keywords.get("limit")
        return decoder_layer.moe(router, self.num_experts, self.top_k, self.route_mode,
                                 None if activation is silu_and_mul else clamp, gate_up, down, biases,
                                 None if q is None else q.int8_path, () if q is None else q.down_cuts)

    def stack(self, kernel: ctypes.CDLL) -> None:
        """Run on the grouped kernel from now on: its packed weights replace the Linears."""
        packed = {}
        for name in ("gate_up_proj", "down_proj"):
            layers = [getattr(expert, name) for expert in self.experts]
            packed[name] = pack([layer.weight for layer in layers], [layer.bias for layer in layers])
        self.stacked, self.kernel = (packed["gate_up_proj"], (packed["down_proj"],)), kernel
        self.experts = None

    def use_quantized(self, gate_up: QuantizedWeight | tuple[QuantizedWeight, ...], down: QuantizedWeight,
                      gate_up_bias: torch.Tensor | None = None,
                      down_bias: torch.Tensor | None = None) -> None:
        """Run on `grouped_quant_gemm` from now on, over the experts' weights as stored: the
        per-expert Linears are freed. `gate_up` [E, 2I, H], or its parts along the rows, holds
        each expert's I gate rows first, then its I up rows, the order `activation` reads
        ([gate | up]): a GGUF file's ffn_gate_exps and ffn_up_exps as two parts (each read in
        place, each in its own format), or gpt-oss's interleaved rows gathered into halves;
        `down` [E, H, I]. Biases ([E, 2I] in the same row order, [E, H]) are kept as float32
        and added to the float32 sums, rounded once to the rows' dtype, as the grouped kernel
        adds its biases. Shapes must be those of the Linears they replace (a tensor-parallel
        rank's slice, where sharded)."""
        parts = (gate_up,) if isinstance(gate_up, QuantizedWeight) else tuple(gate_up)
        for name, weights in (("gate_up", parts), ("down", (down,))):
            layer = getattr(self.experts[0], f"{name}_proj")
            expected = (self.num_experts, layer.out_features, layer.in_features)
            got = [tuple(w.shape) for w in weights]
            if (any(len(s) != 3 or (s[0], s[2]) != expected[::2] for s in got)
                    or sum(s[1] for s in got) != expected[1]):
                raise ValueError(f"quantized experts' {name} weight is {got[0] if len(got) == 1 else got}, "
                                 f"the layer's experts are {expected}")
        biases = [None if b is None else b.float().contiguous() for b in (gate_up_bias, down_bias)]
        int8_path = int8.best_path() if int8.chosen([*parts, down]) else None
        self.quantized = QuantizedExperts(parts, down, *biases, int8_path=int8_path)
        self.experts = None

    def widen(self, dtype: torch.dtype, device: torch.device) -> None:
        """Back on per-expert Linears of `dtype` on `device`: the quantized experts dequantized."""
        q = self.quantized
        gate_up = torch.cat([dequantize(part) for part in q.gate_up], dim=1)
        e, two_i, hidden = gate_up.shape
        with on_meta():
            experts = nn.ModuleList(Expert(hidden, two_i // 2, bias=False) for _ in range(e))
        for name, weight, bias in (("gate_up_proj", gate_up, q.gate_up_bias),
                                   ("down_proj", dequantize(q.down), q.down_bias)):
            for i, expert in enumerate(experts):
                layer = getattr(expert, name)
                layer.weight = nn.Parameter(weight[i].to(device=device, dtype=dtype), requires_grad=False)
                if bias is not None:
                    layer.bias = nn.Parameter(bias[i].to(device=device, dtype=dtype), requires_grad=False)
        self.experts, self.quantized = experts, None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; ids [T, k] expert of each of a token's k slots; weights [T, k]."""
        tokens, k = ids.shape
        if tokens == 1:
            counts, rows, scale, slots = self._one_token(x, ids, weights)
        else:
            flat = ids.reshape(-1)
            by_expert = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=self.num_experts).tolist()
            rows = x.index_select(0, by_expert // k)
            scale = weights.reshape(-1, 1).index_select(0, by_expert).to(x.dtype)
            # Each token's k rows, in ascending expert id (their order in `rows`).
            slots = torch.argsort(by_expert).view(tokens, k).sort(dim=1).values.reshape(-1)
        if self.quantized is not None:
            downs = self._on_quantized(counts, rows)
        else:
            project = self._on_kernel if self.stacked else self._on_linears
            hidden = self.activation(project(counts, rows, "gate_up_proj"))
            downs = (project(counts, hidden[:, cols].contiguous(), "down_proj", part)
                     for part, cols in enumerate(self.down_parts))
        out = None
        for down in downs:
            summed = self._weighted_sum(down, scale, slots, tokens, k).to(x.dtype)
            out = summed if out is None else out.add_(summed)
        return out if self.sum_over_ranks is None else self.sum_over_ranks(out)

    def _weighted_sum(self, down: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor | None,
                      tokens: int, k: int) -> torch.Tensor:
        """float32 [tokens, H]: a token's weighted outputs (product in the rows' dtype) added in
        float32 one at a time in ascending expert id, a fixed order: index_add_'s sums, without
        the parallel region it opens even on a decode step's few rows (waking the threads cost a
        batch-1 step of the 30B-A3B shape ~8 %); float32 rows in one call (moe_sum_f32), where
        torch's ops were a dozen a layer."""
        lib = self.sum_kernel
        if lib is NotImplemented:
            lib = available().elementwise(down.dtype, down.device)
        if lib is not None and down.dtype == torch.float32 and down.device.type == "cpu":
            return moe_sum(lib, down, scale, slots, tokens)
        weighted = down.mul_(scale)
        weighted = (weighted if slots is None else weighted.index_select(0, slots)).view(tokens, k, -1)
        summed = torch.zeros(tokens, down.shape[1], dtype=torch.float32, device=down.device)
        for slot in range(k):
            summed.add_(weighted[:, slot])
        return summed

    def _one_token(self, x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> tuple[list[int], torch.Tensor, torch.Tensor, None]:
        """forward's (counts, rows, scale, slots) for a decode step's lone token from its k ids
        in Python: the same rows in the same order, without the sorts and gathers of a batch
        (~10 torch calls a layer; at batch 1 a 48-layer MoE's step spent milliseconds on them).
        Its rows are already its slots in ascending expert id: slots None."""
        flat = ids[0].tolist()
        order = sorted(range(len(flat)), key=flat.__getitem__)  # stable, as argsort's
        counts = [0] * self.num_experts
        for expert in flat:
            counts[expert] += 1
        scale = weights.reshape(-1, 1)[order].to(x.dtype)
        return counts, x.expand(len(flat), -1).contiguous(), scale, None

    def _on_kernel(self, counts: list[int], rows: torch.Tensor, name: str, part: int = 0) -> torch.Tensor:
        """Projection `name` (of the down projection, its part `part`) as one kernel call over
        rows grouped by expert (no padding: the kernel's rows never depend on their group)."""
        gate_up, downs = self.stacked
        packed = gate_up if name == "gate_up_proj" else downs[part]
        return grouped_gemm(self.kernel, rows, packed, _groups(counts))

    def _on_quantized(self, counts: list[int], rows: torch.Tensor) -> list[torch.Tensor]:
        """Both projections on the quantized weights, grouped as `_on_kernel` groups them: the
        down projection's outputs, one per part of `down_parts` (its bias in the first)."""
        groups = _groups(counts)
        q = self.quantized
        expert_of_row = (None if q.gate_up_bias is None and q.down_bias is None
                         else torch.repeat_interleave(groups[:, 0], groups[:, 2]))
        sizes = [part.shape[1] for part in q.gate_up]
        biases = [None] * len(sizes) if q.gate_up_bias is None else q.gate_up_bias.split(sizes, dim=1)
        # Each part's columns are their own sums: the same bits as one weight of all the rows.
        gate_up = torch.cat([_quantized_projection(rows, part, bias, groups, expert_of_row, q.int8_path)[0]
                             for part, bias in zip(q.gate_up, biases)], dim=1)
        hidden = self.activation(gate_up)
        return _quantized_projection(hidden, q.down, q.down_bias, groups, expert_of_row, q.int8_path,
                                     q.down_cuts).unbind(0)

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


def _groups(counts: list[int]) -> torch.Tensor:
    """The grouped kernels' groups [G, 3] int64 (expert, first row, row count) of the active
    experts, rows in ascending expert id."""
    groups, first = [], 0
    for e, n in enumerate(counts):
        if n:
            groups.append((e, first, n))
            first += n
    return torch.tensor(groups, dtype=torch.int64)


def _quantized_projection(rows: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
                          groups: torch.Tensor, expert_of_row: torch.Tensor | None,
                          int8_path: int | None, k_parts: tuple[range, ...] = ()) -> torch.Tensor:
    """float32 sums (rows widened exactly; on int8's arithmetic at `int8_path`, quantized), plus
    each row's expert bias, rounded once to the rows' dtype: [1, R, N], or with `k_parts` each
    part's sums apart [len(k_parts), R, N], the bias in the first (as tensor-parallel ranks
    compute them, the bias on rank 0)."""
    parts = list(k_parts) or None
    y = (grouped_quant_gemm(rows.float(), weight, groups, parts) if int8_path is None
         else grouped_int8_gemm(rows.float(), weight, groups, int8_path, parts))
    y = y if k_parts else y[None]
    if bias is not None:
        y[0] += bias.index_select(0, expert_of_row)
    return y.to(rows.dtype)


class SparseMoeBlock(Experts):
    """The router (`gate`) and the experts of one layer, named as transformers names them; with
    `shared_intermediate`, also a shared expert every token goes through, scaled by
    sigmoid(shared_expert_gate)."""

    router_name = "gate"

    def __init__(self, hidden: int, num_experts: int, intermediate: int, top_k: int,
                 norm_topk_prob: bool, shared_intermediate: int = 0):
        super().__init__(num_experts, hidden, intermediate, bias=False, activation=silu_and_mul)
        self.gate = Linear(hidden, num_experts, bias=False)
        # The whole layer runs as one C call only on our kernels, and never with a shared expert.
        self.gate.wants_ours = not shared_intermediate
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        if shared_intermediate:
            self.shared_expert = MLP(hidden, shared_intermediate)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    @property
    def route_mode(self) -> int:
        return ROUTES["ROUTE_SOFTMAX_TOPK_NORM" if self.norm_topk_prob else "ROUTE_SOFTMAX_TOPK"]

    def torch_route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, self.top_k, self.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routed(self.gate(x))
        routed = super().forward(x, ids, weights)
        if not hasattr(self, "shared_expert"):
            return routed
        # One gate per token ([T, 1]): lanewise, or a token's gate would depend on T.
        return routed + lanewise(torch.sigmoid, self.shared_expert_gate(x)) * self.shared_expert(x)


def stack_experts(model: nn.Module) -> None:
    """Put every CPU Experts of `model` on the grouped kernel, where it runs here and a row's
    bits come out the same at every row count on the experts' own shapes (checked, as the
    dense layers' are; otherwise they stay on packed Linears)."""
    layers = [m for m in model.modules() if isinstance(m, Experts) and m.experts is not None]
    weight = layers[0].experts[0].down_proj.weight if layers else None
    if weight is None or weight.dtype not in KERNELS or weight.device.type != "cpu":
        return
    kernel = available().grouped
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


def widen_unsupported_experts(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Dequantize, to `dtype` on `device`, the quantized experts no kernel here reads (a device
    other than the CPU, or a format without a kernel on this CPU), with one log line saying so."""
    widened = set()
    for layer in model.modules():
        if isinstance(layer, Experts) and layer.quantized is not None:
            qtypes = {weight.qtype for weight in layer.quantized.weights}
            if device.type != "cpu" or not all(supported(t) for t in qtypes):
                widened |= qtypes
                layer.widen(dtype, device)
    if widened:
        where = f"on {device.type}" if device.type != "cpu" else "for this CPU"
        log.info("%s experts dequantized to %s at load: no quantized kernel %s",
                 "/".join(sorted(t.name for t in widened)), str(dtype).removeprefix("torch."), where)


def take_stacked_experts(model: nn.Module, state: dict[str, torch.Tensor | QuantizedWeight]) -> None:
    """Out of `state`, each Experts layer's projections stacked as a GGUF file stores them
    (`<layer>.experts.{gate,up,down}_proj.weight`, [E, out, in]; gpt-oss's biases `....bias`, [E,
    out]): kept quantized on the layer (`use_quantized`, gate and up as parts) where all three
    are, else put back as per-expert float entries (`<layer>.experts.{e}.gate_up_proj.weight`,
    [gate | up] rows, `down_proj`, their biases) (a part in a format without a kernel here, or
    whose blocks a tensor-parallel part cut, was dequantized at load: so are its partners, with
    one log line)."""
    widened = []
    for name, layer in model.named_modules():
        prefix = f"{name}.experts."
        if not isinstance(layer, Experts) or f"{prefix}gate_proj.weight" not in state:
            continue
        gate, up, down = (state.pop(f"{prefix}{p}_proj.weight") for p in ("gate", "up", "down"))
        gate_b, up_b, down_b = (state.pop(f"{prefix}{p}_proj.bias", None) for p in ("gate", "up", "down"))
        gate_up_bias = None if gate_b is None else torch.cat([gate_b, up_b], dim=1)
        if all(isinstance(w, QuantizedWeight) for w in (gate, up, down)):
            layer.use_quantized((gate, up), down, gate_up_bias, down_b)
            continue
        if any(isinstance(w, QuantizedWeight) for w in (gate, up, down)):
            widened.append(name)
        gate, up, down = (dequantize(w) if isinstance(w, QuantizedWeight) else w for w in (gate, up, down))
        stacked = {f"{prefix}gate_up_proj": torch.cat([gate, up], dim=1), f"{prefix}down_proj": down}
        if gate_up_bias is not None:
            stacked |= {f"{prefix}gate_up_proj_bias": gate_up_bias, f"{prefix}down_proj_bias": down_b}
        del gate, up, down
        for projection in ("gate_up_proj", "down_proj"):
            stacked = split_stacked_experts(stacked, projection)
        state.update(stacked)
    if widened:
        log.info("experts of %d layers (%s%s) dequantized at load with the part of them that has no "
                 "kernel here or whose blocks a tensor-parallel part cuts", len(widened), ", ".join(widened[:3]),
                 ", ..." if len(widened) > 3 else "")


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
