"""llama.cpp's side of the quantized table (scripts/_bench_quantized.py), run as a child process
under whichever interpreter has llama-cpp-python (its own venv, say: see docs/performance.md for
a build that runs on AMX CPUs), so that a crash of its native code cannot take the table with it.
Imports nothing of ours nor torch: the parent passes everything as JSON and reads JSON back.

    python _llama_cpp_child.py '{"gguf": ..., "ids": [...], "new_tokens": 16, "threads": 2, "repeats": 3}'
"""

from __future__ import annotations

import json
import sys
import time


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(gguf: str, ids: list[int], new_tokens: int, threads: int, repeats: int) -> dict:
    """Seconds of the fastest prefill of `ids` and of the fastest greedy decode of new_tokens - 1
    tokens after it (one sequence: llama-cpp-python runs one at a time), and the resident growth."""
    import llama_cpp

    before = rss_mb()
    llm = llama_cpp.Llama(gguf, n_ctx=len(ids) + new_tokens + 64, n_threads=threads, n_batch=512,
                          verbose=False)

    def prefill() -> float:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - t0

    t_prefill = min(prefill() for _ in range(repeats))
    t_decode = float("inf")
    for _ in range(repeats):
        prefill()
        token = llm.sample(temp=0.0)
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = llm.sample(temp=0.0)
        t_decode = min(t_decode, time.perf_counter() - t0)
    return {"prefill_s": t_prefill, "decode_s": t_decode, "rss_mb": rss_mb() - before,
            "version": llama_cpp.__version__}


if __name__ == "__main__":
    print(json.dumps(run(**json.loads(sys.argv[1]))))
