"""Decode on a busy machine: tokens/s at 1 and 4 clients, quiet and while a second process burns
one core for the whole run, and the ratio of the two (docs/performance.md, "Shared machines").

Each figure is measured in a fresh process (the OpenMP settings are read when torch loads its
libgomp): greedy decode of `--tokens` tokens per client from short prompts, through the scheduler,
the first step (the prompts' prefill) left out. The burner is `python -c "while True: pass"`,
unpinned, started before the model loads and ended after the figure. Each round runs every
figure once, quiet then busy; each figure is the best of its rounds. `--env` compares settings (each as given, quiet and
busy), e.g. the wait policy the package sets against libgomp's own:

    python scripts/bench_contention.py                                   # the default model
    python scripts/bench_contention.py --env GOMP_SPINCOUNT=300000 --env OMP_WAIT_POLICY=PASSIVE
    python scripts/bench_contention.py --shape qwen3-30b-a3b --layers 2  # a synthetic MoE (~0.9 GB)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402

MEASURE = r"""
import json, sys, time
from freetoken.config import WeightsConfig
from freetoken.core import SamplingParams
from freetoken.message import UserMsg
from freetoken.models.registry import load_model
from freetoken.scheduler.factory import build_scheduler
import torch
path, clients, tokens = (sys.argv[1] or None), int(sys.argv[2]), int(sys.argv[3])
loaded = load_model(path, dtype="float32", device="cpu", kv_slots=4096, weights=WeightsConfig(gguf_weights="quantized"))
scheduler = build_scheduler(loaded, kv_slots=4096, prefix_cache=False)
params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
def run(uid0):
    for c in range(clients):
        ids = loaded.tokenizer.encode(f"Request {uid0 + c}: tell me a story about the number {c}.")
        assert scheduler.add(UserMsg(uid0 + c, ids, params)) == []
    scheduler.step()  # the prefill
    t0, made = time.perf_counter(), 0
    while scheduler.has_work:
        made += sum(len(m.token_ids) for m in scheduler.step())
    return made / (time.perf_counter() - t0)
run(0)  # warm: kernels built and probed, pages touched
print(json.dumps({"tok_s": run(1000), "threads": torch.get_num_threads()}))
"""


def measure(path: str, clients: int, tokens: int, env: dict[str, str], busy: bool) -> dict:
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        done = subprocess.run([sys.executable, "-c", MEASURE, path, str(clients), str(tokens)],
                              capture_output=True, text=True, env={**os.environ, **env})
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _setting(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items() if k != "OMP_NUM_THREADS") or "defaults"


def main() -> None:
    p = bc.base_parser(__doc__.split("\n")[0], repeats=False)
    p.add_argument("--clients", default="1,4", help="concurrent requests, comma-separated")
    p.add_argument("--tokens", type=int, default=None, help="decode tokens per client (default 64, 16 with --quick)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every figure (the best of each is kept)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting to compare (repeatable; each its own rows; none: the defaults)")
    p.add_argument("--shape", default=None, help="a synthetic model of scripts/bench_gguf_load.py instead of the default")
    p.add_argument("--layers", type=int, default=2, help="its decoder layers")
    args = p.parse_args()
    bc.setup(args)
    tokens = args.tokens or (16 if args.quick else 64)
    path = ""
    if args.shape:
        from bench_gguf_load import synthetic_model

        path = str(synthetic_model(args.shape, args.layers))
    variants = [{"OMP_NUM_THREADS": str(args.threads), **dict([setting.split("=", 1)])} for setting in args.env] \
        or [{"OMP_NUM_THREADS": str(args.threads)}]
    clients = [int(c) for c in args.clients.split(",")]
    best = {}  # (variant, clients, busy): the best tokens/s of its rounds
    for _ in range(args.rounds):  # each round runs every figure once, so that all see the same spells
        for v, env in enumerate(variants):
            for n in clients:
                for busy in (False, True):
                    tok_s = measure(path, n, tokens, env, busy)["tok_s"]
                    best[v, n, busy] = max(best.get((v, n, busy), 0.0), tok_s)
                    print(f"# {_setting(env)}, {n} client(s), {'busy' if busy else 'quiet'}: {tok_s:.1f} tokens/s",
                          flush=True)
    rows = [[_setting(env), n, bc.fmt(best[v, n, False]), bc.fmt(best[v, n, True]),
             bc.ratio(best[v, n, True], best[v, n, False])] for v, env in enumerate(variants) for n in clients]
    bc.print_table(f"Decode tokens/s, quiet and beside a process burning one core ({Path(path).name or 'default model'}, "
                   f"{args.threads} threads, {tokens} tokens a client)",
                   ["setting", "clients", "quiet", "busy", "busy / quiet"], rows)
    bc.load_note()


if __name__ == "__main__":
    main()
