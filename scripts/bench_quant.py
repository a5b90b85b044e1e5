"""The quantized-weight kernels (kernels/quant.py) per GGUF format, against torch's float32
F.linear on the same weights dequantized, in the same process.

For each format and shape, quant_linear at 1, 8, 32 and 512 rows: milliseconds, GFLOP/s, GB/s of
weight bytes read (what bounds a decode step), and torch's time over ours; then the default
model's linear layers (SmolLM2-135M: Q4_1 projections, fused as the engine fuses them, and the
Q8_0 tied head) for one decode step of 1, 8 and 32 rows, as a bound on decode tokens/s. The
heading gives the CPU, the kernel's path (AVX2 or AVX-512), a plain memory read (torch's sum
over 512 MiB on the same threads) to show how far the 1-row figures are from the bandwidth bound,
and the vector units' peaks on the same threads (unit_peaks.c: float32 FMAs, AVX512-BF16's dot
product, and the int8 products of AVX2, AVX-VNNI and AVX512-VNNI where the CPU has them), the
most an exact float32 kernel, a bfloat16 one, or the int8 arithmetic can reach.
Each figure is the fastest of its calls over at least --seconds.

Last, which of the two bounds a few-row call meets (--ceilings): per format, the weight bytes a
second one thread gets through with the weight in its L2 (the kernel's own rate, times the
threads: what the cores could do), against all threads reading weights from memory (a set of
them larger than the L3), beside a plain read of the same bytes with torch's threads.

With --int8, only the int8 arithmetic (`--quantized-arithmetic int8`, kernels/int8.py) on each
vector path the CPU runs (AVX2, AVX512-VNNI, AVX-VNNI) against the exact kernel on Qwen3-8B's
gate/up shape in Q4_K_M's formats and MXFP4, at decode and prefill row counts, the calls
alternated so that a busy moment slows each.

    python scripts/bench_quant.py [--threads 2] [--formats Q4_1,Q8_0] [--quick] [--int8]
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _bench_common import base_parser, best_time, print_table, ratio, setup
from gguf import GGMLQuantizationType

from freetoken.kernels import int8, quant
from freetoken.kernels.build import build
from freetoken.layers.kernel_choice import cpu_name

SHAPES = ((4096, 4096), (576, 1536))  # (N, K): a 7B-class projection, the default model's down_proj
ROWS = (1, 8, 32, 512)
# SmolLM2-135M's linears per layer (qkv, o, gate_up, down; N x K) x 30 layers, and its head.
MODEL_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
MODEL_LAYERS, MODEL_HEAD = 30, (49152, 576)
UNITS = ((0, "float32 FMA"), (1, "AVX512-BF16 dot"), (2, "int8 AVX2 maddubs"), (3, "int8 AVX-VNNI dpbusd"),
         (4, "int8 AVX512-VNNI dpbusd"))  # unit_peaks.c's kinds
INT8_SHAPE, INT8_ROWS = (12288, 4096), (1, 4, 8, 256)  # Qwen3-8B's gate/up (N x K)


def unit_peaks() -> str:
    """Each vector unit's peak on torch's threads, GFLOP/s (2 per multiply-add)."""
    lib = ctypes.CDLL(str(build(Path(__file__).with_name("unit_peaks.c"))))
    lib.unit_peak.argtypes, lib.unit_peak.restype = [ctypes.c_int, ctypes.c_long], ctypes.c_double
    peaks = []
    for kind, name in UNITS:
        if lib.unit_supported(kind):
            lib.unit_peak(kind, 10**6)  # warm-up: the clocks and the thread team
            peaks.append(f"{name} {2 * lib.unit_peak(kind, 10**8) / 1e9:.0f}")
    return ", ".join(peaks)


def memory_read_gbs(repeats: int, seconds: float = 0.0) -> float:
    """A plain read of 512 MiB (torch's sum, on its threads): memory's rate, for comparison."""
    values = torch.ones(128 << 20)
    return values.nbytes / best_time(values.sum, repeats, seconds) / 1e9


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--formats", default=",".join(t.name for t in quant.FORMATS),
                   help="comma-separated GGUF types")
    p.add_argument("--seconds", type=float, default=0.3, help="least time spent on each figure")
    p.add_argument("--ceilings", action=argparse.BooleanOptionalAction, default=True,
                   help="the compute-or-memory table at 1 and 8 rows")
    p.add_argument("--int8", action="store_true", help="only the int8 arithmetic against the exact one")
    args = p.parse_args()
    setup(args)
    if args.int8:
        return int8_table(args)
    if not quant.supported(GGMLQuantizationType.Q4_0):
        raise SystemExit("no quantized-weight kernel on this CPU (see quant.py)")
    path = {v: k for k, v in quant.ISAS.items()}[quant.isa()]
    print(f"# cpu: {cpu_name()}; quant kernel path: {path}; "
          f"plain memory read (torch sum, {args.threads} threads): {memory_read_gbs(args.repeats, args.seconds):.1f} GB/s; "
          f"unit peaks (GFLOP/s, {args.threads} threads): {unit_peaks()}", flush=True)
    shapes = SHAPES[1:] if args.quick else SHAPES
    rows_list = ROWS[:3] if args.quick else ROWS
    for n, k in shapes:
        table = []
        for name in args.formats.split(","):
            qtype = GGMLQuantizationType[name]
            weight = quant.random_weight(qtype, (n, k))
            dense = quant.dequantize(weight)
            for rows in rows_list:
                x = torch.randn(rows, k)
                quant.quant_linear(x, weight, None), F.linear(x, dense)  # warm-up
                ours = best_time(lambda: quant.quant_linear(x, weight, None), args.repeats, args.seconds)
                torch_s = best_time(lambda: F.linear(x, dense), args.repeats, args.seconds)
                table.append([name, rows, f"{ours * 1e3:.3f}", 2 * rows * n * k / ours / 1e9,
                              weight.nbytes / ours / 1e9, f"{torch_s * 1e3:.3f}", ratio(torch_s, ours)])
        print_table(f"{n}x{k} (N x K), {args.threads} thread(s), {time.strftime('%Y-%m-%d')}",
                    ["format", "rows", "ours ms", "GFLOP/s", "weight GB/s", "torch f32 ms", "torch / ours"],
                    table)
    model_step(args)
    if args.ceilings:
        ceilings(args)


def int8_table(args) -> None:
    """The int8 arithmetic's kernel on each path this CPU runs against the exact one, each figure
    the best of its calls, the calls alternated call by call."""
    paths = {name: p for name, p in int8.PATHS.items() if p and int8.runs(p)}
    best_name = {v: k for k, v in int8.PATHS.items()}[int8.best_path()]  # (scalar: every run's)
    paths = paths or {"scalar": 0}
    table = []
    for qtype in int8.FORMATS:
        weight = quant.random_weight(qtype, INT8_SHAPE)
        runs = {"exact": quant.QuantParts([weight], [None]),
                **{name: int8.Int8Parts([weight], [None], path=p) for name, p in paths.items()}}
        for rows in INT8_ROWS:
            x = torch.randn(rows, INT8_SHAPE[1])
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(max(args.repeats, 3)):
                for name, run in runs.items():
                    best[name] = min(best[name], best_time(lambda: run(x), 1, args.seconds / 3))
            table.append([qtype.name, rows, *(f"{best[name] * 1e3:.2f}" for name in runs),
                          ratio(best["exact"], best[best_name]),
                          ratio(best["avx2"], best[best_name]) if "avx2" in best else "-"])
    print_table(f"int8 arithmetic on each path against exact, {INT8_SHAPE[0]}x{INT8_SHAPE[1]} (N x K), "
                f"{args.threads} thread(s), {cpu_name()}, {time.strftime('%Y-%m-%d')}",
                ["format", "rows", "exact ms", *(f"{name} ms" for name in paths), f"exact / {best_name}",
                 f"avx2 / {best_name}"], table)
    print(f"unit peaks (GFLOP/s, or GOP/s of byte products, {args.threads} threads): {unit_peaks()}")


def model_step(args) -> None:
    """All of the default model's linears for one decode step, ours against float32 F.linear."""
    weights = [quant.random_weight(GGMLQuantizationType.Q4_1, shape, seed=i)
               for i in range(MODEL_LAYERS) for shape in MODEL_LAYER]
    weights.append(quant.random_weight(GGMLQuantizationType.Q8_0, MODEL_HEAD))
    dense = [quant.dequantize(w) for w in weights]
    table = []
    for rows in (1, 8, 32):
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        ours = best_time(lambda: [quant.quant_linear(xs[w.shape[1]], w, None) for w in weights],
                         args.repeats, args.seconds)
        torch_s = best_time(lambda: [F.linear(xs[d.shape[1]], d) for d in dense], args.repeats, args.seconds)
        table.append([rows, f"{ours * 1e3:.2f}", rows / ours, sum(w.nbytes for w in weights) / ours / 1e9,
                      f"{torch_s * 1e3:.2f}", ratio(torch_s, ours)])
    print_table(f"SmolLM2-135M Q4_1 linears + Q8_0 head, one decode step, {args.threads} thread(s)",
                ["rows", "ours ms", "tokens/s bound", "weight GB/s", "torch f32 ms", "torch / ours"], table)


# (N, K): small enough for one core's L2 in every format (Q8_0: 870 KB), K a whole super-block.
IN_L2, FROM_MEMORY_BYTES = (1024, 768), 256 << 20


def ceilings(args) -> None:
    """Few-row calls: the kernel's rate on a weight in L2 against its rate on weights from memory."""
    read_gbs = memory_read_gbs(args.repeats, args.seconds)
    table = []
    for name in args.formats.split(","):
        qtype = GGMLQuantizationType[name]
        near = quant.random_weight(qtype, IN_L2)
        # Each call also pays a fixed cost (the Python call, the output, waking threads): a
        # 16-column weight's call, taken off every call, so that both rates are the kernel's.
        tiny = quant.random_weight(qtype, (16, IN_L2[1]))
        copies = FROM_MEMORY_BYTES // near.nbytes
        far = [quant.random_weight(qtype, IN_L2, seed=i) for i in range(copies)]
        for rows in (1, 8):
            x = torch.randn(rows, IN_L2[1])
            kernel_s = []  # one thread on `near`, every thread on `far`
            for threads, weights in ((1, [near]), (args.threads, far)):
                torch.set_num_threads(threads)
                fixed = best_time(lambda: quant.quant_linear(x, tiny, None), args.repeats, args.seconds)
                calls = best_time(lambda: [quant.quant_linear(x, w, None) for w in weights], args.repeats,
                                  args.seconds)
                kernel_s.append(calls - fixed * len(weights))
            cores = near.nbytes / kernel_s[0] * args.threads / 1e9
            got = near.nbytes * copies / kernel_s[1] / 1e9
            table.append([name, rows, f"{cores:.1f}", f"{got:.1f}", f"{read_gbs:.1f}",
                          "compute" if cores < read_gbs else "memory"])
    print_table(f"Few-row calls, weight GB/s: what the cores could compute ({IN_L2[0]}x{IN_L2[1]} in one "
                f"core's L2, x {args.threads} threads), what they get from memory ({FROM_MEMORY_BYTES >> 20} "
                f"MiB of such weights, {args.threads} threads), a plain read; each call's fixed cost taken off",
                ["format", "rows", "cores, weight in L2", "from memory", "plain read", "the lower ceiling"],
                table)


if __name__ == "__main__":
    main()
