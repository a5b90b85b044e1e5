"""The quantized table of bench_engine.py (`--tables quantized`): prefill and decode tokens/s on
a GGUF with its blocks kept quantized (FREETOKEN_GGUF_WEIGHTS=quantized) against our float32 and
bfloat16 runs on the same blocks dequantized at load, and llama.cpp where it is installed: its own
`llama-batched-bench` (--llama-cpp-bin: every batch of the table) or llama-cpp-python (a child
process under --llama-python; batch 1: it runs one sequence at a time), each in a process of its
own so that a crash of its native code cannot take the table with it; with each side's
weight bytes and the process's resident memory once it has run (VmRSS: a mapped GGUF's pages
count as they are read; llama.cpp's: the child's peak).

--quantized-models picks the files, one table each: `default` (the default model's GGUF), `8b`,
`30b-a3b`, `gpt-oss-20b` (bench_gguf_load.py's synthetic Qwen3-8B and Qwen3-30B-A3B-shaped
Q4_K_M, gpt-oss-20b-shaped MXFP4 as released; written under the cache on first use), or a path.
--quantized-arithmetic exact,int8 adds a row of ours on the int8 arithmetic. A dequantized run whose weights would exceed --dequantized-max-gib is not made (an
8B is 30 GiB in float32, 15 GiB in bfloat16): the table says so, as it does when the loader's
memory check refuses one.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _bench_common as bc
from _llama_cpp_child import rss_mb
from bench_gguf_load import synthetic_model
from freetoken.config import WeightsConfig
from freetoken.models.gguf_file import open_gguf, planned_bytes
from freetoken.models.registry import load_model
from freetoken.paths import ModelNotFound

# --quantized-models names that bench_gguf_load.py writes (its SHAPES).
SYNTHETIC = {"8b": "qwen3-8b", "30b-a3b": "qwen3-30b-a3b", "gpt-oss-20b": "gpt-oss-20b"}
# Under --quick, a file over BIG (an 8B's decode step is a quarter of a second or more on two
# cores) runs these sizes at most: its table then takes a few minutes.
BIG, QUICK_BIG = 2**30, dict(batch=8, prefill_len=32, new_tokens=8)


def quantized_model(name: str) -> Path:
    if name == "default":
        return bc.default_gguf()
    return synthetic_model(SYNTHETIC[name]) if name in SYNTHETIC else Path(name)


def quantized_table(ours_class, batches: list[int], prefill_len: int, new_tokens: int, args) -> None:
    """`ours_class`: bench_engine.Ours, built on a LoadedModel (its `loaded` replaced)."""
    for name in args.quantized_models.split(","):
        path = quantized_model(name)
        sizes = batches, prefill_len, new_tokens
        if args.quick and path.stat().st_size > BIG:
            sizes = ([b for b in batches if b <= QUICK_BIG["batch"]] or batches[:1],
                     min(prefill_len, QUICK_BIG["prefill_len"]), min(new_tokens, QUICK_BIG["new_tokens"]))
            bc.note(f"{path.name} under --quick: batches {sizes[0]}, prefill {sizes[1]} tokens, "
                    f"decode {sizes[2]} new tokens")
        model_table(ours_class, path, *sizes, args)


def model_table(ours_class, path: Path, batches: list[int], prefill_len: int, new_tokens: int, args) -> None:
    # The pool the runs need, not --kv-slots: an 8B's float32 KV is 288 KiB a token.
    kv_slots = min(args.kv_slots, max(batches) * (max(prefill_len, args.decode_prompt_len) + new_tokens) + 256)
    rows = []
    runs = [("quantized", "float32", mode) for mode in args.quantized_arithmetic.split(",")]
    for weights, dtype, mode in runs + [("dequantized", d, "exact") for d in args.dequantized_dtypes.split(",") if d]:
        label = (f"ours quantized{'' if mode == 'exact' else ', ' + mode}" if weights == "quantized"
                 else f"ours {dtype}")
        if weights == "dequantized" and (why := too_big(path, dtype, args.dequantized_max_gib)):
            bc.note(f"{label}: not run: {why}")
            continue
        gc.collect()
        before = rss_mb()
        try:
            loaded = load_model(path, dtype=dtype, device="cpu", kv_slots=kv_slots,
                                weights=WeightsConfig(gguf_weights="quantized" if weights == "quantized" else "float32",
                                                      quantized_arithmetic=mode))
        except ModelNotFound as exc:
            bc.note(f"{label}: not run: the loader refused it ({exc})")
            continue
        ours = ours_class.on(loaded, kv_slots)
        tok = loaded.tokenizer
        pre_prompts = bc.token_prompts(tok, max(batches), prefill_len, seed=1)
        dec_prompts = bc.token_prompts(tok, max(batches), args.decode_prompt_len, seed=2)
        ours.decode(dec_prompts[:1], 2)  # warm-up
        weight_mb = sum(loaded.model.weight_bytes.values()) / 2**20
        for b in batches:
            t_pre = bc.best_time(lambda: ours.prefill(pre_prompts[:b]), args.repeats)
            t_dec, steps = min(ours.decode(dec_prompts[:b], new_tokens) for _ in range(args.repeats))
            rows.append([label, b, b * prefill_len / t_pre, b * (new_tokens - 1) / t_dec,
                         bc.ms(t_dec / steps), weight_mb, rss_mb() - before])
        del ours, loaded
    bin_dir = args.llama_cpp_bin or os.environ.get("FREETOKEN_LLAMA_CPP_BIN")
    if bin_dir:
        rows += llama_batched_bench_rows(Path(bin_dir), path, batches, prefill_len, new_tokens, args)
    else:
        rows += llama_cpp_rows(path, prefill_len, new_tokens, args)
    bc.print_table(f"Quantized weights: {path.name}, prefill {prefill_len}-token prompts (tokens/s; MB: "
                   "weights as held, and the process's resident growth once run)",
                   ["weights", "batch", "prefill", "decode", "ms/step", "weights MB", "RSS MB"], rows)
    bc.note(f"the file is {path.stat().st_size / 2**20:,.0f} MB; ours float32 / bfloat16: on its blocks "
            "dequantized at load")


def too_big(path: Path, dtype: str, max_gib: float) -> str | None:
    """Why the dequantized `dtype` run of `path` is not made, or None."""
    held = sum(planned_bytes(open_gguf(path), bc.DTYPES[dtype], quantized=False).values()) / 2**30
    if held <= max_gib:
        return None
    return (f"its dequantized weights would hold {held:.1f} GiB, over --dequantized-max-gib "
            f"{max_gib:g} (raise it where the memory is there; the dequantization takes minutes)")


def llama_batched_bench_rows(bin_dir: Path, path: Path, batches: list[int], prefill_len: int,
                             new_tokens: int, args) -> list[list]:
    """llama.cpp's `llama-batched-bench` on the same file and thread count: `b` sequences each
    prefilled with prompts of prefill_len (and of decode_prompt_len) tokens, then decoded
    together for new_tokens steps; the best of args.repeats runs."""
    tool = bin_dir / "llama-batched-bench"
    prompt_lens = sorted({prefill_len, args.decode_prompt_len})
    cmd = [str(tool), "-m", str(path), "-t", str(args.threads or 2),
           "-c", str(max(batches) * (max(prompt_lens) + new_tokens) + 64),
           "-npp", ",".join(map(str, prompt_lens)), "-ntg", str(new_tokens),
           "-npl", ",".join(map(str, batches)), "--output-format", "jsonl", *args.llama_cpp_args.split()]
    best: dict[tuple[int, int], dict] = {}
    peak_mb = 0.0
    for _ in range(args.repeats):
        with tempfile.TemporaryFile("w+") as stderr:
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
            stdout = child.stdout.read()
            # wait4, not communicate(): the child's own peak, not the largest of all our children's.
            _, status, usage = os.wait4(child.pid, 0)
            if code := os.waitstatus_to_exitcode(status):
                stderr.seek(0)
                bc.note(f"llama.cpp ({tool}): ended with code {code} "
                        f"({stderr.read().strip().splitlines()[-1:] or 'no message'})")
                return []
        peak_mb = max(peak_mb, usage.ru_maxrss / 1024)
        for line in stdout.splitlines():
            if line.startswith("{"):
                run = json.loads(line)
                key = (run["pl"], run["pp"])
                if key not in best or run["t"] < best[key]["t"]:
                    best[key] = run
    bc.note(f"llama.cpp: {tool} {' '.join(cmd[1:])}; decode after {args.decode_prompt_len}-token "
            f"prompts; RSS MB: its process's peak")
    return [["llama.cpp", b, best[b, prefill_len]["speed_pp"], best[b, args.decode_prompt_len]["speed_tg"],
             bc.ms(b / best[b, args.decode_prompt_len]["speed_tg"]), None, peak_mb]
            for b in batches]


def llama_cpp_rows(path: Path, prefill_len: int, new_tokens: int, args) -> list[list]:
    """llama.cpp at batch 1 in a child process (_llama_cpp_child.py) under --llama-python (or
    FREETOKEN_LLAMA_PYTHON; default this interpreter)."""
    python = args.llama_python or os.environ.get("FREETOKEN_LLAMA_PYTHON") or sys.executable
    if python == sys.executable and importlib.util.find_spec("llama_cpp") is None:
        bc.note("llama.cpp: llama-cpp-python is not installed (docs/performance.md: building it in a "
                "venv of its own, --llama-python)")
        return []
    job = {"gguf": str(path), "ids": bc.token_prompts(bc.load_tokenizer(), 1, prefill_len, seed=1)[0],
           "new_tokens": new_tokens, "threads": args.threads or 2, "repeats": args.repeats}
    child = subprocess.run([python, str(Path(__file__).with_name("_llama_cpp_child.py")), json.dumps(job)],
                           capture_output=True, text=True)
    if child.returncode:
        bc.note(f"llama.cpp ({python}): its process ended with code {child.returncode} "
                f"({child.stderr.strip().splitlines()[-1:] or 'no message'})")
        return []
    out = json.loads(child.stdout.strip().splitlines()[-1])
    bc.note(f"llama.cpp: llama-cpp-python {out['version']} under {python}")
    return [["llama.cpp", 1, prefill_len / out["prefill_s"], (new_tokens - 1) / out["decode_s"],
             bc.ms(out["decode_s"] / (new_tokens - 1)), None, out["rss_mb"]]]
