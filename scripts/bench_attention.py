"""Decode steps with attention on the pool kernel (kernels/pool_attention.py) against
torch's gather + SDPA, A/B in one process, step after step.

Per model and context length: the largest batch's prompts are prefilled once, then decode steps
alternate between the two paths (the kernel switched off by replacing `pool_attention.usable`);
requests are aborted down to each smaller batch. Each figure is the median step time of its side.
Models: the default model's weights as float32 and bfloat16, and the default GGUF as it loads
(its blocks kept quantized).

    python scripts/bench_attention.py                 # contexts 100 and 1000, batches 1, 8, 32
    python scripts/bench_attention.py --quick         # context 100, batches 1 and 8
    python scripts/bench_attention.py --kernel-paths  # the kernel alone: its AVX2 vs AVX-512 path
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc
from bench_engine import Ours
from freetoken.kernels import pool_attention
from freetoken.models.registry import load_model

# name: (read the HF folder, not the GGUF; dtype)
MODELS = {"float32": (True, "float32"), "bfloat16": (True, "bfloat16"), "gguf": (False, "float32")}


def timed_step(ours: Ours, kernel: bool, clock=time.perf_counter) -> float:
    usable = pool_attention.usable
    if not kernel:
        pool_attention.usable = lambda _: False
    try:
        t0 = clock()
        ours.scheduler.step()
        return clock() - t0
    finally:
        pool_attention.usable = usable


# name: (requests, rows a request, keys a row's last query sees): prompt rows see keys 1..n
KERNEL_CASES = {"32 prompts x 40": (32, 40, 40), "4 prompts x 512": (4, 512, 512),
                "8 decoding x 500": (8, 1, 500), "1 decoding x 100": (1, 1, 100)}


def kernel_paths_table(args, heads: int = 9, kv_heads: int = 3, dim: int = 64) -> None:
    """The kernel alone on the default model's attention shape, its AVX2 path against its
    AVX-512 one (the same bits), each figure the median of interleaved calls."""
    import torch

    lib = pool_attention.load()
    best = lib.pool_attention_set_isa(2)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (requests, queries, keys) in KERNEL_CASES.items():
            cache = torch.randn(requests * keys, 2 * kv_heads, dim, generator=gen).to(dtype)
            slots = torch.arange(requests * keys)
            ranges = torch.tensor([[r * keys, 0, keys - queries + i + 1]
                                   for r in range(requests) for i in range(queries)])
            q = torch.randn(len(ranges), heads, dim, generator=gen).to(dtype)
            times: dict[int, list[float]] = {1: [], best: []}
            for _ in range(args.steps or 15):
                for isa in times:
                    lib.pool_attention_set_isa(isa)
                    t0 = time.perf_counter()
                    pool_attention.attend(q, cache, slots, ranges)
                    times[isa].append(time.perf_counter() - t0)
            avx2, wide = statistics.median(times[1]), statistics.median(times[best])
            rows.append([str(dtype).removeprefix("torch."), name, f"{avx2 * 1e3:.3f}", f"{wide * 1e3:.3f}",
                         bc.ratio(avx2, wide)])
    lib.pool_attention_set_isa(best)
    bc.print_table(f"Pool attention kernel, {heads} heads / {kv_heads} kv heads of {dim}, AVX2 path vs "
                   + ("AVX-512" if best == 2 else "AVX2 (no AVX-512 here)") + " (median ms)",
                   ["dtype", "rows", "AVX2 ms", "best ms", "speed-up"], rows)


def main() -> None:
    p = bc.base_parser(__doc__.splitlines()[0], repeats=False)
    p.add_argument("--models", default="float32,bfloat16,gguf", help=f"of {', '.join(MODELS)}")
    p.add_argument("--contexts", default=None, help="tokens of context (default 100,1000; quick 100)")
    p.add_argument("--batches", default=None, help="default 32,8,1; quick 8,1")
    p.add_argument("--steps", type=int, default=None, help="steps per side and batch (default 9, quick 5)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time the process's CPU seconds, not wall clock (with --threads 1: what a "
                   "loaded machine disturbs least)")
    p.add_argument("--kernel-paths", action="store_true", help="only the kernel alone, AVX2 vs AVX-512 path")
    args = p.parse_args()
    bc.setup(args)
    if args.kernel_paths:
        kernel_paths_table(args)
        bc.load_note()
        return
    contexts = [int(c) for c in (args.contexts or ("100" if args.quick else "100,1000")).split(",")]
    batches = sorted((int(b) for b in (args.batches or ("8,1" if args.quick else "32,8,1")).split(",")),
                     reverse=True)
    steps = args.steps or (5 if args.quick else 9)
    clock = time.process_time if args.cpu_time else time.perf_counter
    rows = []
    for name in args.models.split(","):
        folder, dtype = MODELS[name]
        loaded = load_model(bc.model_folder() if folder else None, dtype=dtype, device="cpu")
        ours = Ours.on(loaded, kv_slots=batches[0] * (max(contexts) + 4 * steps * len(batches) + 8))
        for context in contexts:
            prompts = bc.token_prompts(loaded.tokenizer, batches[0], context, seed=context)
            ours._add(prompts, max_tokens=4 * steps * len(batches) + 8)
            uids = list(range(ours.uid - len(prompts) + 1, ours.uid + 1))
            started: set[int] = set()
            while len(started) < len(prompts):
                started |= {m.uid for m in ours.scheduler.step()}
            for batch in batches:
                while len(uids) > batch:
                    ours.scheduler.abort(uids.pop())
                timed_step(ours, True), timed_step(ours, False)  # warm-up
                times: dict[bool, list[float]] = {True: [], False: []}
                for _ in range(steps):
                    for kernel in (True, False):
                        times[kernel].append(timed_step(ours, kernel, clock))
                on, off = statistics.median(times[True]), statistics.median(times[False])
                rows.append([name, context, batch, bc.ms(off), bc.ms(on), bc.ratio(off, on)])
                print(rows[-1], flush=True)
            for uid in uids:
                ours.scheduler.abort(uid)
            while ours.scheduler.has_work:
                ours.scheduler.step()
        del ours, loaded
    bc.print_table("Decode step, attention on torch (gather + SDPA) vs the pool kernel (median "
                   + ("CPU ms)" if args.cpu_time else "ms)"),
                   ["model", "context", "batch", "torch ms", "kernel ms", "speed-up"], rows)
    bc.load_note()


if __name__ == "__main__":
    main()
