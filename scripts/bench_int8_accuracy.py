"""How far the int8 arithmetic (`--quantized-arithmetic int8`) moves a model from the exact one,
beside how far llama.cpp's own arithmetic moves it, on the same tiny GGUFs.

For each file: greedy decode of --prompts random prompts for --steps tokens on the exact
arithmetic; then every position of those sequences teacher-forced on the exact arithmetic, on
int8, and through llama.cpp (scripts/llama_cpp_logits.c against --llama-cpp's libllama: every
position's logits, as llama-cpp-python's logits_all gives them). Printed per file and side: top-1
agreement with exact, and the mean KL(exact || side) of the next-token distribution, in float64.

    python scripts/bench_int8_accuracy.py [--llama-cpp LLAMA_CPP_TREE] [--steps 200] [--prompts 8]

LLAMA_CPP_TREE: a llama.cpp source tree built with cmake into build/ (docs/performance.md has the
recipe), holding include/llama.h and build/bin/libllama.so.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _bench_common import base_parser, note, print_table, setup  # noqa: E402

from freetoken.config import WeightsConfig  # noqa: E402
from freetoken.models.registry import load_model  # noqa: E402
from freetoken.scheduler.factory import build_scheduler  # noqa: E402
from tests.fixtures import build_models as bm  # noqa: E402
from tests.model_fixtures import greedy_run, teacher_forced_distributions  # noqa: E402

# The tiny GGUFs whose layers int8 runs: dense files holding every block format (Q4_0/Q4_1 parts
# stay exact), Gemma 3 in Q4_K_M's two, Qwen3-MoE in Q8_0 and in llama.cpp's Q4_K_M mix.
FILES = ("tiny-quantized-llama", "tiny-quantized-qwen3", "tiny-quantized-qwen2", "tiny-quantized-gemma3",
         "tiny-quantized-moe-Q8_0", "tiny-quantized-moe-Q4_K_M")


def llama_cpp_tool(tree: Path) -> Path:
    """llama_cpp_logits.c built against `tree` (once per tree)."""
    source = Path(__file__).with_name("llama_cpp_logits.c")
    lib = tree / "build" / "bin"
    out = lib / "freetoken_llama_cpp_logits"
    if not out.is_file() or out.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(["cc", "-O2", "-o", str(out), str(source), f"-I{tree / 'include'}",
                        f"-I{tree / 'ggml' / 'include'}", f"-L{lib}", "-lllama", "-lggml", "-lggml-base",
                        f"-Wl,-rpath,{lib}"], check=True)
    return out


def llama_cpp_distributions(tool: Path, path: Path, sequences: list[list[int]],
                            threads: int) -> list[torch.Tensor] | str:
    """llama.cpp's next-token log-distributions after each of every sequence's ids[:-1], or why
    it gave none."""
    lines = "".join(" ".join(map(str, ids)) + "\n" for ids in sequences)
    out = subprocess.run([str(tool), str(path), str(threads)], input=lines.encode(), capture_output=True)
    if out.returncode:
        said = [line for line in out.stderr.decode(errors="replace").splitlines() if ": " in line]
        return f"refused ({said[0].split(': ', 1)[-1] if said else f'exit code {out.returncode}'})"
    flat = np.frombuffer(out.stdout, dtype=np.float32)
    vocab = flat.size // sum(map(len, sequences))
    rows, at = [], 0
    for ids in sequences:
        logits = torch.from_numpy(flat[at:at + len(ids) * vocab].copy()).view(len(ids), vocab)
        rows.append(logits[:-1].double().log_softmax(-1))
        at += len(ids) * vocab
    return rows


def compare(exact: torch.Tensor, other: torch.Tensor) -> tuple[int, int, float]:
    """(positions whose argmax agrees, positions, sum of KL(exact || other))."""
    width = min(exact.shape[1], other.shape[1])  # llama.cpp's vocabulary may be the padded one
    exact, other = exact[:, :width], other[:, :width]
    kl = (exact.exp() * (exact - other)).sum(-1)
    return int((exact.argmax(-1) == other.argmax(-1)).sum()), len(kl), float(kl.sum())


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--files", default=",".join(FILES), help="the tests' tiny GGUFs, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="greedy tokens after each prompt")
    p.add_argument("--prompts", type=int, default=8, help="random prompts of 8-24 tokens")
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    p.add_argument("--llama-cpp", type=Path, default=None, help="a built llama.cpp tree (see above)")
    args = p.parse_args()
    setup(args)
    tool = llama_cpp_tool(args.llama_cpp) if args.llama_cpp else None
    rows = []
    for name in args.files.split(","):
        path = bm.cached_gguf(name) / "model.gguf"
        models = {mode: load_model(path, dtype="float32", device="cpu", weights=WeightsConfig(
            gguf_weights="quantized", quantized_arithmetic=mode)) for mode in ("exact", "int8")}
        rng = random.Random(args.seed)
        vocab = models["exact"].model.cfg.vocab_size
        prompts = {i: [rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))]
                   for i in range(args.prompts)}
        scheduler = build_scheduler(models["exact"], kv_slots=args.prompts * (args.steps + 64), prefix_cache=False)
        runs, _ = greedy_run(scheduler, prompts, steps=args.steps)
        sequences = [ids + [t for t, _ in runs[uid]] for uid, ids in prompts.items()]
        exact = [teacher_forced_distributions(models["exact"], ids) for ids in sequences]
        sides = {"ours int8": [teacher_forced_distributions(models["int8"], ids) for ids in sequences]}
        if tool:
            sides["llama.cpp"] = llama_cpp_distributions(tool, path, sequences, args.threads or 2)
        for side, dists in sides.items():
            if isinstance(dists, str):
                rows.append([name, side, 0, "-", dists])
                continue
            totals = np.array([compare(e, o) for e, o in zip(exact, dists)]).sum(0)
            rows.append([name, side, int(totals[1]), f"{totals[0] / totals[1]:.3f}", f"{totals[2] / totals[1]:.2e}"])
        del models, exact, sides
    print_table(f"Against the exact arithmetic: {args.prompts} prompts (seed {args.seed}) x {args.steps} greedy "
                "steps (exact's), "
                "teacher-forced", ["file", "side", "positions", "top-1 agreement", "mean KL"], rows)
    if not tool:
        note("llama.cpp: not run (--llama-cpp names a built llama.cpp tree)")


if __name__ == "__main__":
    main()
