"""A llama-family decoder layer in one C call (decoder_layer.c, built at first use like
grouped_gemm.c and sharing its build), for models/llama.py's DecoderLayer.

The C file calls the kernels the Python layer calls, in the same order on the same values, through
their addresses in the libraries quant.py, grouped_gemm.py and pool_attention.py load (one home
per kernel): a row gets the same bits either way. It runs a layer whose four linear layers are on
the quantized kernel (QuantParts), with float32 rows, norms and cache; the rest stays in Python.

`prepare` makes a layer's fixed arguments once; `step` makes a step's once (kept on its
ForwardContext) and returns None where the step cannot run so: FREETOKEN_LAYER_KERNEL=0 (the
Python path, for tests and benchmarks), no kernel here, rows or cache off the CPU or not float32,
or groups without key ranges.
"""

from __future__ import annotations

import ctypes
import math
import os
from functools import cache
from pathlib import Path

import torch

from freetoken.engine.forward_context import ForwardContext
from freetoken.models.kernels import grouped_gemm, pool_attention, quant
from freetoken.models.kernels.grouped_gemm import open_library

SOURCE = Path(__file__).with_name("decoder_layer.c")
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class Kernels(ctypes.Structure):
    _fields_ = [(name, _PTR) for name in ("quant_parts", "rms_norm", "add_rms_norm", "norm_rotate",
                                           "silu_mul", "attention")]


class LinearArgs(ctypes.Structure):
    """A QuantParts' arguments (its `args`, then K and N)."""

    _fields_ = [("parts", _I64), ("types", _PTR), ("w", _PTR), ("ldw", _PTR), ("n", _PTR), ("bias", _PTR),
                ("in_features", _I64), ("out_features", _I64)]


class LayerArgs(ctypes.Structure):
    _fields_ = [("qkv", LinearArgs), ("o", LinearArgs), ("gate_up", LinearArgs), ("down", LinearArgs),
                ("input_norm", _PTR), ("post_norm", _PTR), ("q_norm", _PTR), ("k_norm", _PTR),
                ("eps", _F32), ("post_eps", _F32), ("qk_eps", _F32), ("scale", _F32),
                ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("sliding", _I64)]


class StepArgs(ctypes.Structure):
    _fields_ = [("isa", _I64), ("tokens", _I64), *((name, _PTR) for name in (
        "cos", "sin", "out_slots", "slots", "ranges", "window_ranges",
        "h", "qkv", "q", "attn", "gate_up", "act", "delta"))]


@cache
def load() -> tuple[ctypes.CDLL, Kernels] | None:
    """The built library and the kernels it calls, or None where one of them cannot run here."""
    quant_lib, grouped, attention = quant._kernel(), grouped_gemm.load(), pool_attention.load()
    if quant_lib is None or grouped is None or attention is None:
        return None
    lib = open_library(SOURCE, "decoder_layer_supported", "nothing more", "layers run in Python",
                       {"decoder_layer_f32": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR]})
    if lib is None:
        return None
    functions = (quant_lib.quant_gemm_parts, grouped.rms_norm_f32, grouped.add_rms_norm_f32,
                 grouped.norm_rotate_f32, grouped.silu_mul_f32, attention.pool_attention_f32)
    return lib, Kernels(*(ctypes.cast(f, ctypes.c_void_p).value for f in functions))


class Step:
    """A step's arguments and scratch (kept alive here while the C layers read them)."""

    def __init__(self, args: StepArgs, tensors: list[torch.Tensor], delta: torch.Tensor):
        self.args, self.tensors, self.delta = args, tensors, delta
        self.address = ctypes.addressof(args)


class LayerCall:
    """A layer's fixed arguments, and the call that runs it on a step."""

    def __init__(self, args: LayerArgs, keep: list):
        self.args, self.keep = args, keep  # keep: what the arguments point into
        lib, kernels = load()
        self.run, self.kernels = lib.decoder_layer_f32, ctypes.addressof(kernels)
        self.address = ctypes.addressof(args)

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None, step: Step,
                 kv_cache: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] updated in place (plus `delta`, the previous layer's MLP output, then
        the attention output); returns this layer's MLP output (the step's buffer)."""
        self.run(self.kernels, self.address, step.address, x.data_ptr(),
                 None if delta is None else delta.data_ptr(), 0 if delta is None else delta.stride(0),
                 kv_cache.data_ptr())
        return step.delta


def _linear(parts: quant.QuantParts) -> LinearArgs:
    count, types, blocks, strides, sizes, biases = parts.args
    return LinearArgs(count, ctypes.addressof(types), ctypes.addressof(blocks), ctypes.addressof(strides),
                      ctypes.addressof(sizes), ctypes.addressof(biases), parts.k, parts.n)


def prepare(linears: tuple[quant.QuantParts, ...], norms: tuple, heads: int, kv_heads: int,
            head_dim: int, sliding: bool) -> LayerCall | None:
    """A layer with projections `linears` (q/k/v, o, gate/up, down) and RMSNorms `norms` (input,
    post-attention, then q's and k's, or not), or None where the C layer cannot run it."""
    weights = [n.weight for n in norms]
    qkv, o, gate_up, down = linears
    hidden, intermediate = qkv.k, down.k
    if (load() is None or any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous()
                              for w in weights)
            or hidden % 8 or head_dim % 16 or intermediate % 8 or gate_up.n != 2 * intermediate
            or qkv.n != (heads + 2 * kv_heads) * head_dim or o.k != heads * head_dim
            or o.n != hidden or gate_up.k != hidden or down.n != hidden
            or (len(norms) == 4 and norms[2].eps != norms[3].eps)):
        return None
    qk = weights[2:] or [None, None]
    args = LayerArgs(_linear(qkv), _linear(o), _linear(gate_up), _linear(down),
                     weights[0].data_ptr(), weights[1].data_ptr(),
                     *(None if w is None else w.data_ptr() for w in qk),
                     norms[0].eps, norms[1].eps, norms[2].eps if len(norms) == 4 else 0.0,
                     1.0 / math.sqrt(head_dim), hidden, heads, kv_heads, head_dim, intermediate, sliding)
    return LayerCall(args, [linears, weights])


def step(ctx: ForwardContext, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         layer: LayerCall) -> Step | None:
    """The step's arguments for `layer` and the layers after it (made by the first to ask), or
    None where the step's layers run in Python."""
    made = ctx.layer_step
    if made is None or (made and made.args.tokens != x.shape[0]):
        made = ctx.layer_step = _make_step(ctx, x, cos, sin, layer.args) or False
    return made or None


def _make_step(ctx: ForwardContext, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               layer: LayerArgs) -> Step | None:
    kv_cache = ctx.kv_cache[0]
    if (os.environ.get("FREETOKEN_LAYER_KERNEL") == "0" or x.dtype != torch.float32
            or x.device.type != "cpu" or x.dim() != 2 or not x.is_contiguous()
            or cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()
            or kv_cache.dtype != torch.float32 or not pool_attention.usable(kv_cache)):
        return None
    tokens = x.shape[0]
    keys = ctx.merged_keys(tokens)
    if keys is None:
        return None
    out_slots = ctx.out_slots.to(torch.int64).contiguous()
    width = layer.heads * layer.head_dim
    scratch = [torch.empty(tokens, n) for n in (
        layer.hidden, layer.qkv.out_features, width, width, 2 * layer.intermediate, layer.intermediate,
        layer.hidden)]
    tensors = [cos, sin, out_slots, keys.slots, keys.ranges, keys.window_ranges, *scratch]
    args = StepArgs(quant.isa(), tokens, *(t.data_ptr() for t in tensors))
    return Step(args, tensors, scratch[-1])
