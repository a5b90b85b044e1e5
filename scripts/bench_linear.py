"""Every linear-kernel candidate (layers/linear.py) that runs the dtype here, on the default
model's projection shapes, at decode's and scoring's row counts: GFLOP/s and the ratio to a
baseline candidate, each call timed in turn with the others (best of --repeats), one process.
Called in one piece, no row rule: the kernels as the probe times them (docs/engine/kernels.md,
"Kernels").

    python scripts/bench_linear.py --dtype bfloat16             # ~20 s
    python scripts/bench_linear.py --dtype float32 --baseline torch
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc
from freetoken.layers.kernel_choice import cpu_name
from freetoken.layers.linear import CANDIDATES, Linear, prepare

# (in, out): the default model's q/k/v, o, gate/up and down projections and its LM head.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
ROWS = (1, 8, 32, 64, 512)


def main() -> None:
    p = bc.base_parser(__doc__, repeats=False)
    p.add_argument("--dtype", choices=list(bc.DTYPES), default="bfloat16")
    p.add_argument("--baseline", choices=CANDIDATES, default="onednn")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = bc.DTYPES[args.dtype]
    shapes, rows = (SHAPES[:2], ROWS[:2]) if args.quick else (SHAPES, ROWS)
    print(f"# cpu: {cpu_name()}; {args.dtype}, {args.threads} threads; best of {args.repeats}")
    for k, n in shapes:
        layer = Linear(k, n, bias=False, dtype=dtype).requires_grad_(False)
        runs = {name: run for name in CANDIDATES if (run := prepare(name, layer)) is not None}
        if args.baseline not in runs:
            sys.exit(f"{args.baseline} does not run {args.dtype} here")
        print(f"\n### {k} x {n}: GFLOP/s (ratio to {args.baseline})\n")
        print("| rows | " + " | ".join(runs) + " |")
        print("|---" * (len(runs) + 1) + "|")
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            best = dict.fromkeys(runs, float("inf"))
            for repeat in range(args.repeats + 1):  # round 0 warms up, untimed
                for name, run in runs.items():
                    t0 = time.perf_counter()
                    run(x)
                    if repeat:
                        best[name] = min(best[name], time.perf_counter() - t0)
            rate = {name: 2 * m * k * n / t / 1e9 for name, t in best.items()}
            cells = [f"{rate[name]:.0f} ({rate[name] / rate[args.baseline]:.2f}x)" for name in runs]
            print(f"| {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
