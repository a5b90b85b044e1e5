"""A llama-family decoder layer in one C call (csrc/decoder_layer.c, built at first use by
build.py), for models/llama.py's DecoderLayer. Its structs are kernels.h's, mirrored by build.py.

The C file calls the kernels the Python layer calls, in the same order on the same values, through
their addresses in the libraries quant.py, grouped_gemm.py and pool_attention.py load (one home
per kernel): a row gets the same bits either way. It runs a layer whose rows, norms and KV pool
share one dtype and whose four projections are on our kernels: float32 rows on the quantized
kernel (QuantParts, or Int8Parts on the int8 arithmetic) or the grouped one, bfloat16 rows on a
bfloat16 unit's (bf16_linear.py); the rest stays in Python. A sparse MLP (layers/moe.py's
SparseMoeBlock: router, route, experts, weighted sum) runs in the call too, float32 rows, its
experts on the grouped, quantized or int8 kernel (`moe`).

`prepare` makes a layer's fixed arguments once, `stack` a model's layers' (one call runs them
all), both at load where the kernel plan allows the call (kernels/plan.py: the library runs here
and FREETOKEN_LAYER_KERNEL=0 does not ask for the Python path); `step` makes a step's once (kept
on its ForwardContext) and returns None where the step cannot run so: rows or cache off the CPU or
of another dtype, groups without key ranges.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from freetoken.kvcache.forward_context import ForwardContext
from freetoken.kernels import bf16_linear, build, grouped_gemm, int8, pool_attention, quant

_C = build.declarations()
Kernels, LinearArgs, LayerArgs, StepArgs, ExpertsArgs, MoeArgs = (
    _C.structs[name] for name in ("kernels", "linear", "layer", "step", "experts_weight", "moe"))
QUANT, GROUPED, INT8 = _C.enums["QUANT"], _C.enums["GROUPED"], _C.enums["INT8"]  # kinds of linear layer

UNIT_KINDS = {"amx": _C.enums["AMX"], "avx512_bf16": _C.enums["DOT"]}
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@cache
def load() -> ctypes.CDLL | None:
    """The built library, or None where the kernels it calls cannot run here."""
    if grouped_gemm.load() is None or pool_attention.load() is None:
        return None
    return build.open_library("decoder_layer", "decoder_layer_supported", "nothing more", "layers run in Python")


@cache
def kernels(dtype: torch.dtype) -> Kernels:
    """The addresses of the kernels a layer of `dtype` calls (None: one this CPU lacks)."""
    grouped, attention, quantized, int8_lib = grouped_gemm.load(), pool_attention.load(), quant._kernel(), int8._kernel()
    suffix, address = SUFFIX[dtype], build.address
    return Kernels(address(quantized, "quant_gemm_parts"), address(grouped, "grouped_gemm_f32"),
                   address(grouped, "grouped_gemm_bf16"),
                   *map(bf16_linear.address, UNIT_KINDS),
                   *(address(grouped, f"{name}_{suffix}") for name in
                     ("rms_norm", "add_rms_norm", "norm_rotate", "silu_mul")),
                   address(attention, f"pool_attention_{suffix}"), address(grouped, "round_to_bf16"),
                   address(int8_lib, "int8_gemm_parts"), address(int8_lib, "int8_gemm_grouped"),
                   address(quantized, "quant_gemm"), address(grouped, "moe_route_f32"),
                   address(grouped, "moe_sum_f32"), address(grouped, "clamped_swiglu_f32"))


class Step:
    """A step's arguments and scratch (kept alive here while the C layers read them)."""

    def __init__(self, args: StepArgs, tensors: list[torch.Tensor], delta: torch.Tensor, key: tuple):
        self.args, self.tensors, self.delta = args, tensors, delta
        self.key = key  # (rows, the shape of the layers whose scratch it holds)
        self.address = ctypes.addressof(args)


class LayerCall:
    """A layer's fixed arguments, and the call that runs it on a step."""

    def __init__(self, args: LayerArgs, dtype: torch.dtype, keep: list, lib: ctypes.CDLL, sparse: Moe | None):
        self.args, self.dtype, self.keep, self.sparse = args, dtype, keep, sparse  # keep: what args point into
        self.shape = (dtype, args.hidden, args.qkv.out_features, args.heads * args.head_dim, args.intermediate,
                      sparse and sparse.shape)
        self.lib, self.run, self.kernels = lib, lib.decoder_layer, ctypes.addressof(kernels(dtype))
        self.address = ctypes.addressof(args)

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None, step: Step,
                 kv_cache: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] updated in place (plus `delta`, the previous layer's MLP output, then
        the attention output); returns this layer's MLP output (the step's buffer)."""
        self.run(self.kernels, self.address, step.address, x.data_ptr(),
                 None if delta is None else delta.data_ptr(), 0 if delta is None else delta.stride(0),
                 kv_cache.data_ptr())
        return step.delta


class Stack:
    """A model's layers (LayerCalls of one shape, each on the KV cache of its index) in one call a
    step: what the layers' Python loop cost (~10 us a layer) goes."""

    def __init__(self, calls: list[LayerCall], caches: list[int]):
        self.first, self.count, self.caches = calls[0], len(calls), caches
        self.layers = (ctypes.c_void_p * len(calls))(*(call.address for call in calls))
        self.run = self.first.lib.decoder_layers

    def __call__(self, x: torch.Tensor, step: Step, kv_cache: list[torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] through every layer, updated in place but for the last layer's MLP
        output, which it returns (the step's buffer)."""
        caches = (ctypes.c_void_p * self.count)(*(kv_cache[i].data_ptr() for i in self.caches))
        self.run(self.first.kernels, self.layers, self.count, step.address, x.data_ptr(), caches)
        return step.delta


def stack(calls: list[LayerCall | None], caches: list[int]) -> Stack | None:
    """Layers `calls` (None: one that runs in Python), layer i on KV cache caches[i], as one call;
    None unless every layer has a call and all are of one shape (a step's scratch fits them all)."""
    if not calls or any(call is None or call.shape != calls[0].shape for call in calls):
        return None
    return Stack(calls, caches)


def _linear(run, dtype: torch.dtype) -> tuple[LinearArgs, object] | None:
    """A projection's arguments: `run` a QuantParts or Int8Parts (float32 rows), or a Linear's run
    on the grouped kernel (weights of the rows' dtype) or a bfloat16 unit's (bfloat16); None: another."""
    if isinstance(run, (quant.QuantParts, int8.Int8Parts)):
        exact = run if isinstance(run, quant.QuantParts) else run.exact
        if dtype != torch.float32:
            return None
        count, types, blocks, strides, sizes, biases, k_parts, cuts = exact.args
        kind, path = (QUANT, 0) if exact is run else (INT8, run.path)
        return LinearArgs(kind, count, *map(ctypes.addressof, (types, blocks, strides, sizes, biases)),
                          k_parts, None if cuts is None else ctypes.addressof(cuts), None, None,
                          run.k, run.n, path), run
    func = getattr(run, "func", None)
    if func is grouped_gemm.grouped_gemm:
        packed = run.keywords["experts"]
        if packed.weight.dtype != dtype:
            return None
        bias = None if packed.bias is None else packed.bias.data_ptr()
        return LinearArgs(GROUPED, 0, None, None, None, None, None, 0, None, packed.weight.data_ptr(), bias,
                          packed.in_features, packed.out_features), packed
    if func is bf16_linear.unit_linear and dtype == torch.bfloat16:
        unit, packed, bias, out_features = run.args
        return LinearArgs(UNIT_KINDS[unit], 0, None, None, None, None, None, 0, None, packed.data_ptr(),
                          None if bias is None else bias.data_ptr(), packed.shape[1] * 32, out_features), run
    return None


class Moe:
    """A sparse MLP's arguments (`moe`), what they point into, and the shape of its step scratch."""

    def __init__(self, args: MoeArgs, keep: list, hidden: int):
        self.args, self.keep, self.hidden = args, keep, hidden
        self.shape = (args.experts, args.top_k, args.intermediate, args.down_parts)


def moe(router, experts: int, top_k: int, route: int, activation: tuple[float, float] | None, gate_up: tuple,
        down, biases: tuple[torch.Tensor | None, torch.Tensor | None], int8_path: int | None,
        down_cuts: tuple[range, ...] = ()) -> Moe | None:
    """A sparse MLP's arguments for `prepare`: `router` a run `_linear` takes on float32 rows,
    `route` a mode of grouped_gemm.ROUTES over its `experts` outputs to the `top_k`, the experts'
    projections: gate_up, one grouped_gemm.PackedLinears of float32 weights, or the quantized parts
    [E, n, H] of each expert's gate rows then up rows (one or two), and down ([E, H, I]; quantized,
    K in `down_cuts` parts, each part's weighted sum added in part order), quantized ones on the
    int8 arithmetic at `int8_path` (None: the exact kernel), with float32 `biases` ([E, 2I], [E, H]
    or None; packed experts: their own); between them SwiGLU, or with `activation` (alpha, limit)
    gpt-oss's clamped one. None where the call cannot run them."""
    made = _linear(router, torch.float32)
    if made is None or made[0].out_features != experts or not 0 < top_k <= experts or len(gate_up) > 2:
        return None
    router_args, router_keep = made
    if isinstance(down, grouped_gemm.PackedLinears):
        packs = (*gate_up, down)
        if len(gate_up) != 1 or any(p.weight.dtype != torch.float32 for p in packs):
            return None
        hidden, intermediate, two_i = down.out_features, down.in_features, gate_up[0].out_features
        biases = (gate_up[0].bias, down.bias)
        kind, parts, cuts, weights = GROUPED, [ExpertsArgs()] * 3, None, (gate_up[0].weight, down.weight)
        keep = [router_keep, packs]
    else:
        blocks = [quant.blocks(w) for w in (*gate_up, down)]
        parts = [ExpertsArgs(int(w.qtype), b.data_ptr(), b.stride(0), b.stride(1), w.shape[1])
                 for w, b in zip((*gate_up, down), blocks)]
        hidden, intermediate, two_i = down.shape[1], down.shape[2], sum(w.shape[1] for w in gate_up)
        if any(w.shape[2] != hidden for w in gate_up) or any(
                b is not None and (b.dtype != torch.float32 or not b.is_contiguous()) for b in biases):
            return None
        if len(gate_up) == 1:
            parts.insert(1, ExpertsArgs())
        kind, weights = QUANT if int8_path is None else INT8, (None, None)
        cuts = (ctypes.c_int64 * (len(down_cuts) + 1))(*(r.start for r in down_cuts), intermediate) if down_cuts else None
        keep = [router_keep, blocks, biases, cuts]
    if two_i != 2 * intermediate or intermediate % 8 or router_args.in_features != hidden:
        return None
    alpha, limit = activation or (0.0, 0.0)
    args = MoeArgs(router_args, *parts, *(None if w is None else w.data_ptr() for w in weights),
                   *(None if b is None else b.data_ptr() for b in biases), kind, int8_path or 0, experts, top_k,
                   route, activation is not None, intermediate, len(down_cuts) or 1,
                   cuts and ctypes.addressof(cuts), alpha, limit)
    return Moe(args, keep, hidden)


def prepare(lib: ctypes.CDLL | None, linears: tuple, norms: tuple, heads: int, kv_heads: int, head_dim: int,
            sliding: bool, rotary: bool, scale: float | None, residual: float,
            sparse: Moe | None = None, sinks: torch.Tensor | None = None) -> LayerCall | None:
    """A layer with projections `linears` (q/k/v, o, then the MLP's gate/up and down, or with a
    sparse MLP `sparse` (`moe`'s) q/k/v and o alone: see `_linear`), attention `sinks` (float32
    [heads], gpt-oss's; None: a plain softmax) and RMSNorms
    `norms` (input, post-attention, then q's and k's, or not), q and k turned by the rotary
    embedding or not, its attention scores scaled by `scale` (pool_attention.softmax_scale), the
    attention's and MLP's outputs by `residual`, on `lib` (the plan's: `load()`, or None where
    the layers run in Python), or None where the C layer cannot run it."""
    weights = [n.weight for n in norms]
    dtype = weights[0].dtype
    if (lib is None or dtype not in SUFFIX
            or any(w.dtype != dtype or w.device.type != "cpu" or not w.is_contiguous() for w in weights)
            # norm_rotate norms q and k only on the way to turning them (no family has one without)
            or (len(norms) == 4 and (norms[2].eps != norms[3].eps or not rotary))):
        return None
    made = [_linear(run, dtype) for run in linears]
    if any(m is None for m in made) or (sparse is not None and (dtype != torch.float32 or sparse.hidden
                                                                 != made[0][0].in_features)):
        return None
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (heads,) or not sinks.is_contiguous()):
        return None
    (qkv, _), (o, _), *mlp = made
    (gate_up, _), (down, _) = mlp or [(LinearArgs(), None)] * 2
    hidden, intermediate = qkv.in_features, down.in_features
    if (hidden % 8 or head_dim % 16 or intermediate % 8
            or qkv.out_features != (heads + 2 * kv_heads) * head_dim or o.in_features != heads * head_dim
            or o.out_features != hidden or (mlp and (gate_up.out_features != 2 * intermediate
                                                     or gate_up.in_features != hidden or down.out_features != hidden))):
        return None
    qk = weights[2:] or [None, None]
    args = LayerArgs(qkv, o, gate_up, down, weights[0].data_ptr(), weights[1].data_ptr(),
                     *(None if w is None else w.data_ptr() for w in qk),
                     norms[0].eps, norms[1].eps, norms[2].eps if len(norms) == 4 else 0.0,
                     pool_attention.softmax_scale(head_dim, scale), residual, hidden, heads, kv_heads, head_dim,
                     intermediate, sliding, rotary, None if sparse is None else ctypes.addressof(sparse.args),
                     None if sinks is None else sinks.data_ptr())
    return LayerCall(args, dtype, [made, weights, sparse, sinks], lib, sparse)


def step(ctx: ForwardContext, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         layer: LayerCall) -> Step | None:
    """The step's arguments for `layer` and the layers after it (made by the first to ask), or
    None where the step's layers run in Python."""
    made = ctx.layer_step
    if made is None or (made and made.key != (x.shape[0], layer.shape)):
        made = ctx.layer_step = _make_step(ctx, x, cos, sin, layer) or False
    return made or None


def _make_step(ctx: ForwardContext, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               layer: LayerCall) -> Step | None:
    kv_cache, dtype = ctx.kv_cache[0], layer.dtype
    if (x.dtype != dtype or x.device.type != "cpu"
            or x.dim() != 2 or not x.is_contiguous() or cos.dtype != dtype or not cos.is_contiguous()
            or cos.shape[-1] != layer.args.head_dim
            or not sin.is_contiguous() or kv_cache.dtype != dtype or kv_cache.device.type != "cpu"
            or not kv_cache.is_contiguous()):
        return None
    tokens = x.shape[0]
    keys = ctx.merged_keys(tokens)
    if keys is None:
        return None
    out_slots = ctx.out_slots.to(torch.int64).contiguous()
    groups = torch.tensor([[0, 0, tokens]])
    args, width = layer.args, layer.args.heads * layer.args.head_dim
    linears = (args.qkv, args.o, args.gate_up, args.down)
    x32 = torch.empty(tokens, max(l.in_features for l in linears))  # a bfloat16 layer on the grouped kernel
    y32 = torch.empty(tokens, max(l.out_features for l in linears))
    h, qkv = torch.empty(tokens, args.hidden, dtype=dtype), torch.empty(tokens, args.qkv.out_features, dtype=dtype)
    q, attn32 = torch.empty(tokens, width), torch.empty(tokens, width)
    attn = attn32 if dtype == torch.float32 else torch.empty(tokens, width, dtype=dtype)
    gate_up, act, delta = (torch.empty(tokens, n, dtype=dtype)
                           for n in (2 * args.intermediate, args.intermediate, args.hidden))
    tensors = [cos, sin, out_slots, keys.slots, keys.ranges, keys.window_ranges, groups, x32, y32,
               h, qkv, q, attn32, attn, gate_up, act, delta]
    if layer.sparse is not None:
        experts, top_k, intermediate, parts = layer.sparse.shape
        rows = tokens * top_k
        tensors += [torch.empty(tokens, experts), torch.empty(tokens, top_k), torch.empty(rows),
                    *(torch.empty(rows, n) for n in (args.hidden, 2 * intermediate, intermediate)),
                    torch.empty(parts, rows, args.hidden), torch.empty(tokens, args.hidden),
                    *(torch.empty(n, dtype=torch.int64) for n in (rows, rows, rows, 3 * experts,
                                                                   max(experts + 1, tokens)))]
    step_args = StepArgs(quant.isa(), tokens, dtype == torch.bfloat16, *(t.data_ptr() for t in tensors))
    return Step(step_args, tensors, delta, (tokens, layer.shape))
