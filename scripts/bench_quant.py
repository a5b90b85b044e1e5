"""The quantized-weight kernels (models/kernels/quant.py) per GGUF format, against torch's float32
F.linear on the same weights dequantized, in the same process.

For each format and shape, quant_linear at 1, 8, 32 and 512 rows: milliseconds, GFLOP/s, GB/s of
weight bytes read (what bounds a decode step), and torch's time over ours. The heading gives the
CPU, the kernel's path (AVX2 or AVX-512) and a plain memory read (a numpy sum over 512 MiB) to
show how far the 1-row figures are from the bandwidth bound.

    python scripts/bench_quant.py [--threads 2] [--formats Q4_1,Q8_0] [--quick]
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from _bench_common import base_parser, best_time, print_table, ratio, setup
from gguf import GGMLQuantizationType

from freetoken.models.kernels import quant
from freetoken.models.layers.kernel_choice import cpu_name

SHAPES = ((4096, 4096), (576, 1536))  # (N, K): a 7B-class projection, the default model's down_proj
ROWS = (1, 8, 32, 512)


def memory_read_gbs(repeats: int) -> float:
    values = np.ones(128 << 20, dtype=np.float32)
    return values.nbytes / best_time(values.sum, repeats) / 1e9


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--formats", default=",".join(t.name for t in quant.FORMATS),
                   help="comma-separated GGUF types")
    args = p.parse_args()
    setup(args)
    if not quant.supported(GGMLQuantizationType.Q4_0):
        raise SystemExit("no quantized-weight kernel on this CPU (see quant.py)")
    path = {v: k for k, v in quant.ISAS.items()}[quant.isa()]
    print(f"# cpu: {cpu_name()}; quant kernel path: {path}; "
          f"plain memory read (numpy sum): {memory_read_gbs(args.repeats):.1f} GB/s", flush=True)
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
                repeats = max(1, args.repeats if rows < 512 else args.repeats // 2)
                quant.quant_linear(x, weight, None), F.linear(x, dense)  # warm-up
                ours = best_time(lambda: quant.quant_linear(x, weight, None), repeats * 3)
                torch_s = best_time(lambda: F.linear(x, dense), repeats * 3)
                table.append([name, rows, f"{ours * 1e3:.3f}", 2 * rows * n * k / ours / 1e9,
                              weight.nbytes / ours / 1e9, f"{torch_s * 1e3:.3f}", ratio(torch_s, ours)])
        print_table(f"{n}x{k} (N x K), {args.threads} thread(s), {time.strftime('%Y-%m-%d')}",
                    ["format", "rows", "ours ms", "GFLOP/s", "weight GB/s", "torch f32 ms", "torch / ours"],
                    table)


if __name__ == "__main__":
    main()
