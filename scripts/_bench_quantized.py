"""The quantized table of bench_engine.py (`--tables quantized`): prefill and decode tokens/s on
the default GGUF with its blocks kept quantized (FREETOKEN_GGUF_WEIGHTS=quantized) against our
float32 run on the same blocks dequantized at load, and llama.cpp (llama-cpp-python, in a child
process so that a crash of its native code cannot take the table with it; batch 1: it runs one
sequence at a time) where it is installed; with each side's
weight bytes and the process's resident memory once it has run (VmRSS: a mapped GGUF's pages
count as they are read).
"""

from __future__ import annotations

import gc
import importlib.util
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import _bench_common as bc

from freetoken.models.registry import load_model


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def quantized_table(ours_class, batches: list[int], prefill_len: int, new_tokens: int, args) -> None:
    """`ours_class`: bench_engine.Ours, built on a LoadedModel (its `loaded` replaced)."""
    rows = []
    for weights in ("quantized", "float32"):
        gc.collect()
        before = rss_mb()
        loaded = load_model(None, dtype="float32", device="cpu", gguf_weights=weights)
        ours = ours_class.on(loaded, args.kv_slots)
        tok = loaded.tokenizer
        pre_prompts = bc.token_prompts(tok, max(batches), prefill_len, seed=1)
        dec_prompts = bc.token_prompts(tok, max(batches), args.decode_prompt_len, seed=2)
        ours.decode(dec_prompts[:1], 2)  # warm-up
        weight_mb = sum(loaded.model.weight_bytes.values()) / 2**20
        for b in batches:
            t_pre = bc.best_time(lambda: ours.prefill(pre_prompts[:b]), args.repeats)
            t_dec, steps = min(ours.decode(dec_prompts[:b], new_tokens) for _ in range(args.repeats))
            rows.append([f"ours {weights}", b, b * prefill_len / t_pre, b * (new_tokens - 1) / t_dec,
                         bc.ms(t_dec / steps), weight_mb, rss_mb() - before])
        del ours, loaded
    rows += llama_cpp_rows(prefill_len, new_tokens, args)
    bc.print_table("Quantized weights: the default GGUF (tokens/s; MB: weights as held, and the "
                   "process's resident growth once run)",
                   ["weights", "batch", "prefill", "decode", "ms/step", "weights MB", "RSS MB"], rows)
    bc.note("the file is " f"{bc.default_gguf().stat().st_size / 2**20:,.0f} MB")


def llama_cpp_rows(prefill_len: int, new_tokens: int, args) -> list[list]:
    if importlib.util.find_spec("llama_cpp") is None:
        bc.note("llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python builds it "
                "from source, ~5 min)")
        return []
    spawn = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(1, mp_context=spawn) as child:
            return child.submit(_llama_cpp_rows, prefill_len, new_tokens, args.threads or 2,
                                args.repeats).result()
    except BrokenProcessPool:
        bc.note("llama.cpp: its process died while running the model (a crash in llama-cpp-python)")
        return []


def _llama_cpp_rows(prefill_len: int, new_tokens: int, threads: int, repeats: int) -> list[list]:
    import llama_cpp

    before = rss_mb()
    llm = llama_cpp.Llama(str(bc.default_gguf()), n_ctx=prefill_len + new_tokens + 64,
                          n_threads=threads, n_batch=512, verbose=False)
    ids = bc.token_prompts(bc.load_tokenizer(), 1, prefill_len, seed=1)[0]

    def prefill() -> None:
        llm.reset()
        llm.eval(ids)

    t_pre = bc.best_time(prefill, repeats)
    best = float("inf")
    for _ in range(repeats):
        prefill()
        token = llm.sample(temp=0.0)
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = llm.sample(temp=0.0)
        best = min(best, time.perf_counter() - t0)
    return [["llama.cpp", 1, prefill_len / t_pre, (new_tokens - 1) / best,
             bc.ms(best / (new_tokens - 1)), None, rss_mb() - before]]
