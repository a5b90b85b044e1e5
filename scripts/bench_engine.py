"""Engine throughput: prefill and decode tokens/s at batch 1, 8, 32, ours vs HF transformers.

Our side goes through the scheduler (`build_scheduler`, `UserMsg`, `scheduler.step()`), greedy
with `ignore_eos`, exactly as the server's engine process drives it. HF transformers runs the
very same weights in the same process and the same thread count:
  prefill: one forward over the batch (`logits_to_keep=1`, so its LM head runs on the last
           position only, as ours does);
  decode:  `generate(max_new_tokens=N, min_new_tokens=N, do_sample=False)` minus the same call
           with N = 1 (which is its prefill and first token), over B * (N - 1) tokens.
Our decode time is likewise the steps after every request has its first token. The prefix cache
is off here (repeats reuse prompts); bench_scoring.py measures it.
The second table is the cost of logprobs: our decode at batch 8 with logprobs None / 0 / 5 / 20.
The third is the cost of the logit processors: our decode at batch 32 with every one of them on
(processor_fields) against the same run without.
The fourth is the cost of structured outputs: our decode at batch 32 with every row under a JSON
schema (GRAMMAR_SCHEMA: an array of objects that cannot end within the run, so that every step
masks every row) against the same rows without, and the mean grammar mask time per step.

    python scripts/bench_engine.py                 # float32, about 2-3 minutes on 2 cores
    python scripts/bench_engine.py --quick
    python scripts/bench_engine.py --tables processors   # one table (no HF: no engine table)
    python scripts/bench_engine.py --tables grammar
    python scripts/bench_engine.py --dtype bfloat16
    python scripts/bench_engine.py --profile       # also: where a decode step's time goes
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402

from freetoken.config import EngineConfig, ParallelConfig  # noqa: E402
from freetoken.core import SamplingParams, StructuredSpec  # noqa: E402
from freetoken.engine.parallel import load_rank, share_cores  # noqa: E402
from freetoken.scheduler.factory import build_scheduler  # noqa: E402
from freetoken.message import UserMsg  # noqa: E402
from freetoken.models.loader import load_model  # noqa: E402
from freetoken.scheduler.worker import rank_main  # noqa: E402
from freetoken.tokenizer.tokenize import bad_words_token_ids  # noqa: E402


class Ours:
    def __init__(self, dtype: str, kv_slots: int, tp_size: int = 1):
        # No prefix cache: repeats reuse prompts, and a cache hit would skip the prefill we time
        # (bench_scoring.py measures the cache).
        config = EngineConfig(dtype=dtype, device="cpu", kv_slots=kv_slots, prefix_cache=False,
                              parallel=ParallelConfig(tp_size=tp_size, master_port=bc.free_port()))
        self.group, self.ranks = None, []
        if tp_size == 1:
            self.loaded = load_model(None, dtype=dtype, device="cpu")
        else:
            self.ranks = start_ranks(config)
            self.loaded, self.group = load_rank(config, 0)
        self.scheduler = build_scheduler(self.loaded, config, self.group)
        if self.group:
            self.group.setup_barrier()
            for ready, _ in self.ranks:
                assert ready.recv() == "ok"
        self.uid = 0

    def close(self) -> None:
        if self.group:
            self.scheduler.engine.close()
            for _, proc in self.ranks:
                proc.join(timeout=10)

    def _add(self, prompts: list[list[int]], max_tokens: int, **fields) -> None:
        """Greedy requests; `fields` override or add SamplingParams fields."""
        for ids in prompts:
            self.uid += 1
            params = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens,
                                       "ignore_eos": True, **fields})
            assert not self.scheduler.add(UserMsg(self.uid, list(ids), params))

    def prefill(self, prompts: list[list[int]]) -> None:
        """Every prompt's forward and its first token (max_tokens = 1)."""
        self._add(prompts, 1)
        while self.scheduler.has_work:
            self.scheduler.step()

    def decode(self, prompts: list[list[int]], new_tokens: int, **fields) -> tuple[float, int]:
        """(seconds, steps) of the decode steps, after every request has its first token."""
        self._add(prompts, new_tokens, **fields)
        started: set[int] = set()
        while len(started) < len(prompts):
            started |= {m.uid for m in self.scheduler.step()}
        steps, t0 = 0, time.perf_counter()
        if self.group:
            self.group.collectives, self.group.collective_s = 0, 0.0
        while self.scheduler.has_work:
            self.scheduler.step()
            steps += 1
        return time.perf_counter() - t0, steps


def start_ranks(config: EngineConfig) -> list:
    """Ranks 1.. of a CPU group on this machine, this process being rank 0: (ready pipe, process)
    each. Every rank, this one included, takes its share of the cores (torch threads)."""
    ctx = mp.get_context("spawn")
    ranks = []
    for rank in range(1, config.parallel.tp_size):
        ready, ready_send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=rank_main, args=(config, rank, ready_send, os.getpid()), daemon=True)
        proc.start()
        ranks.append((ready, proc))
    share_cores(config)
    return ranks


class HF:
    def __init__(self, dtype: str):
        self.model, self.tokenizer = bc.load_hf(dtype)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> None:
        ids = torch.tensor(prompts)  # equal lengths: no padding needed
        self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                   logits_to_keep=1)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(prompts)
        self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            pad_token_id=self.tokenizer.pad_token_id)


def processor_fields(loaded) -> dict:
    """Every logit processor on. EOS is banned by min_tokens, then biased away so that every
    request still runs to max_tokens, as in the run without."""
    [the], [and_] = (loaded.tokenizer.encode(w, add_special_tokens=False) for w in (" the", " and"))
    return dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
                min_tokens=4, ignore_eos=False,
                logit_bias={**{t: -100.0 for t in loaded.eos_token_ids}, the: 1.0, and_: -1.0},
                bad_words_token_ids=bad_words_token_ids(loaded.tokenizer, ["world peace"]))


# Items of a few typed properties; minItems keeps EOS banned, so every row masks every step.
GRAMMAR_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "required": ["id", "name", "tags", "active"],
    "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
                   "active": {"type": "boolean"}}}}


def main() -> None:
    p = bc.base_parser(__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=list(bc.DTYPES), help="both sides")
    p.add_argument("--batches", default="1,8,32", help="batch sizes, comma-separated")
    p.add_argument("--prefill-len", type=int, default=None, help="prompt tokens (default 128, quick 64)")
    p.add_argument("--decode-prompt-len", type=int, default=32, help="prompt tokens before decode")
    p.add_argument("--new-tokens", type=int, default=None, help="decode length (default 32, quick 16)")
    p.add_argument("--logprobs-batch", type=int, default=8, help="batch of the logprobs table")
    p.add_argument("--processors-batch", type=int, default=32,
                   help="batch of the logit processors table")
    p.add_argument("--grammar-batch", type=int, default=32,
                   help="batch of the structured outputs table")
    p.add_argument("--tables", default="engine,logprobs,processors,grammar",
                   help="tables to print, comma-separated")
    p.add_argument("--kv-slots", type=int, default=16384, help="our KV pool, in tokens")
    p.add_argument("--profile", action="store_true",
                   help="profile our decode steps at batch 1 and 32 (torch.profiler + cProfile)")
    p.add_argument("--skip-hf", action="store_true", help="our engine only (no ratios)")
    p.add_argument("--tensor-parallel-size", "--tp-size", type=int, default=1,
                   help="our engine over N CPU ranks on this machine (gloo): the tables run on "
                   "them (no HF), and the tp table compares ms per step with TP=1 (default "
                   "tables: engine,tp)")
    args = p.parse_args()
    bc.setup(args)
    batches = [int(b) for b in args.batches.split(",")]
    tp = args.tensor_parallel_size
    if tp > 1 and args.tables == p.get_default("tables"):
        args.tables = "engine,tp"
    tables = set(args.tables.split(","))
    known = {"engine", "logprobs", "processors", "grammar", "tp"}
    assert tables <= known, f"unknown tables: {args.tables}"
    prefill_len = args.prefill_len or (64 if args.quick else 128)
    new_tokens = args.new_tokens or (16 if args.quick else 32)
    print(f"# dtype {args.dtype}; prefill prompts of {prefill_len} tokens; decode {new_tokens} "
          f"new tokens after {args.decode_prompt_len}-token prompts; greedy, ignore_eos")

    ours = Ours(args.dtype, args.kv_slots)
    tok = ours.loaded.tokenizer
    n = max(batches + [args.logprobs_batch, args.processors_batch, args.grammar_batch])
    pre_prompts = bc.token_prompts(tok, n, prefill_len, seed=1)
    dec_prompts = bc.token_prompts(tok, n, args.decode_prompt_len, seed=2)
    # TP=1 first, with every thread: the ranks of a group must not wait on it (their timeout).
    baseline = tp_baseline(ours, batches, pre_prompts, dec_prompts, new_tokens, args) \
        if "tp" in tables else None
    if tp > 1:
        ours = Ours(args.dtype, args.kv_slots, tp)

    # Warm-up both sides (first calls allocate and pick kernels).
    ours.prefill(pre_prompts[:8])
    ours.decode(dec_prompts[:8], 4)
    hf = None if args.skip_hf or tp > 1 or "engine" not in tables else HF(args.dtype)
    if hf:
        hf.prefill(pre_prompts[:8])
        hf.generate(dec_prompts[:8], 4)

    if "engine" in tables:
        engine_table(ours, hf, batches, pre_prompts, dec_prompts, prefill_len, new_tokens, args)
    if "logprobs" in tables:
        logprobs_table(ours, dec_prompts[:args.logprobs_batch], new_tokens, args)
    if "processors" in tables:
        processors_table(ours, dec_prompts[:args.processors_batch], new_tokens, args)
    if "grammar" in tables:
        grammar_table(ours, dec_prompts[:args.grammar_batch], new_tokens, args)
    if "tp" in tables:
        tp_table(ours, baseline, batches, pre_prompts, dec_prompts, new_tokens, args)
    ours.close()
    bc.load_note()
    if args.profile:
        del hf
        profile(ours, dec_prompts, new_tokens)


def engine_table(ours: Ours, hf: HF | None, batches: list[int], pre_prompts: list[list[int]],
                 dec_prompts: list[list[int]], prefill_len: int, new_tokens: int, args) -> None:
    rows = []
    for b in batches:
        pre, dec = pre_prompts[:b], dec_prompts[:b]
        pre_tokens, dec_tokens = b * prefill_len, b * (new_tokens - 1)
        t_pre = bc.best_time(lambda: ours.prefill(pre), args.repeats)
        t_dec, steps = min(ours.decode(dec, new_tokens) for _ in range(args.repeats))
        hf_pre = hf_dec = None
        if hf:
            hf_pre = pre_tokens / bc.best_time(lambda: hf.prefill(pre), args.repeats)
            t_first = bc.best_time(lambda: hf.generate(dec, 1), args.repeats)
            t_all = bc.best_time(lambda: hf.generate(dec, new_tokens), args.repeats)
            hf_dec = dec_tokens / max(t_all - t_first, 1e-9)
        rows.append([b, pre_tokens / t_pre, hf_pre, bc.ratio(pre_tokens / t_pre, hf_pre),
                     dec_tokens / t_dec, hf_dec, bc.ratio(dec_tokens / t_dec, hf_dec),
                     bc.ms(t_dec / steps)])
    bc.print_table(
        f"Engine vs HF transformers, {args.dtype} (tokens/s; ratio = ours / HF)",
        ["batch", "prefill ours", "prefill HF", "ratio", "decode ours", "decode HF", "ratio",
         "ours ms/step"], rows)


def tp_baseline(base: Ours, batches: list[int], pre_prompts: list[list[int]],
                dec_prompts: list[list[int]], new_tokens: int, args) -> dict[int, tuple[float, float]]:
    """{batch: (prefill s per batch, decode s per step)} at TP=1."""
    base.decode(dec_prompts[:8], 4)  # warm-up
    out = {}
    for b in batches:
        t_pre = bc.best_time(lambda: base.prefill(pre_prompts[:b]), args.repeats)
        t_dec, steps = min(base.decode(dec_prompts[:b], new_tokens) for _ in range(args.repeats))
        out[b] = (t_pre, t_dec / steps)
    return out


def tp_table(ours: Ours, baseline: dict[int, tuple[float, float]], batches: list[int],
             pre_prompts: list[list[int]], dec_prompts: list[list[int]], new_tokens: int,
             args) -> None:
    """TP=1 (all threads) against TP=N (each rank its share of them), and the time rank 0 spends
    in collectives per decode step: the forward's all-gathers and the step plan's broadcast,
    waits for the other ranks included."""
    group = ours.group
    if group is None:
        print("\n(tp table: needs --tensor-parallel-size 2 or more)")
        return
    rows = []
    for b in batches:
        t_pre = bc.best_time(lambda: ours.prefill(pre_prompts[:b]), args.repeats)
        t_dec, steps = min(ours.decode(dec_prompts[:b], new_tokens) for _ in range(args.repeats))
        calls, comm = group.collectives / steps, group.collective_s / steps  # the last repeat
        pre1, dec1 = baseline[b]
        rows.append([b, bc.ms(pre1), bc.ms(t_pre), f"{dec1 * 1000:.1f}", f"{t_dec / steps * 1000:.1f}",
                     bc.ratio(t_dec / steps, dec1), f"{calls:.0f}", f"{comm * 1000:.1f}"])
    w = group.world
    bc.print_table(
        f"Tensor parallelism: TP=1 ({args.threads} threads) vs TP={w} ({torch.get_num_threads()} "
        f"per rank), {args.dtype}; prefill ms per batch, decode ms per step (ratio TP={w} / TP=1); "
        "rank 0's collectives per decode step and their ms",
        ["batch", "prefill TP=1", f"prefill TP={w}", "decode TP=1", f"decode TP={w}", "ratio",
         "collectives", "collective ms"], rows)


def logprobs_table(ours: Ours, dec: list[list[int]], new_tokens: int, args) -> None:
    b = len(dec)
    base = None
    rows = []
    for k in (None, 0, 5, 20):
        t, steps = min(ours.decode(dec, new_tokens, logprobs=k) for _ in range(args.repeats))
        rate = b * (new_tokens - 1) / t
        base = base or rate
        rows.append(["none" if k is None else k, rate, bc.ratio(rate, base), bc.ms(t / steps)])
    bc.print_table(f"Cost of logprobs: our decode at batch {b}, {args.dtype} (ratio to none)",
                   ["logprobs", "decode tok/s", "ratio", "ms/step"], rows)


def processors_table(ours: Ours, dec: list[list[int]], new_tokens: int, args) -> None:
    b, fields = len(dec), processor_fields(ours.loaded)
    best: dict[str, tuple[float, int]] = {}
    for _ in range(args.repeats):
        for name, run_fields in (("none", {}), ("all", fields)):  # alternated: load drift hits both
            run = ours.decode(dec, new_tokens, **run_fields)
            best[name] = min(best.get(name, run), run)
    base = b * (new_tokens - 1) / best["none"][0]
    rows = []
    for name, (t, steps) in best.items():
        rate = b * (new_tokens - 1) / t
        rows.append([name, rate, bc.ratio(rate, base), bc.ms(t / steps)])
    bc.print_table(f"Cost of the logit processors: our decode at batch {b}, {args.dtype} "
                   "(ratio to none)", ["processors", "decode tok/s", "ratio", "ms/step"], rows)


def grammar_table(ours: Ours, dec: list[list[int]], new_tokens: int, args) -> None:
    b = len(dec)
    spec = StructuredSpec("json_schema", json.dumps(GRAMMAR_SCHEMA))
    # EOS stays allowed to the grammar rows (it is banned by the schema's minItems instead).
    fields = dict(structured=spec, ignore_eos=False)
    ours.decode(dec, 4, **fields)  # warm-up: llguidance's tokenizer and the compile
    masks = ours.scheduler.engine.sampler.grammar_masks
    best: dict[str, tuple[float, int]] = {}
    mask_s = mask_steps = 0.0
    for _ in range(args.repeats):
        for name, run_fields in (("none", {}), ("json_schema", fields)):  # alternated for drift
            before = masks.seconds, masks.steps
            run = ours.decode(dec, new_tokens, **run_fields)
            best[name] = min(best.get(name, run), run)
            mask_s += masks.seconds - before[0]
            mask_steps += masks.steps - before[1]
    base = b * (new_tokens - 1) / best["none"][0]
    rows = []
    for name, (t, steps) in best.items():
        rate = b * (new_tokens - 1) / t
        rows.append([name, rate, bc.ratio(rate, base), bc.ms(t / steps)])
    bc.print_table(f"Cost of structured outputs: our decode at batch {b}, every row under a JSON "
                   f"schema, {args.dtype} (ratio to none)",
                   ["rows", "decode tok/s", "ratio", "ms/step"], rows)
    bc.note(f"grammar masks: {mask_s / max(mask_steps, 1) * 1000:.2f} ms per step of {b} rows "
            "(all runs, prefill steps included)")


def profile(ours: Ours, prompts: list[list[int]], new_tokens: int) -> None:
    """Where a decode step's time goes: torch ops (self CPU time) and Python functions."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for b in (1, 32):
        batch = prompts[:b] if b <= len(prompts) else prompts
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            t, steps = ours.decode(batch, new_tokens)
        print(f"\n### torch.profiler, our decode at batch {len(batch)}: {t / steps * 1000:.1f} ms "
              f"per step (profiled)\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        cp = cProfile.Profile()
        cp.enable()
        ours.decode(batch, new_tokens)
        cp.disable()
        print(f"### cProfile, our decode at batch {len(batch)} (cumulative time)\n")
        pstats.Stats(cp).sort_stats("cumulative").print_stats(18)


if __name__ == "__main__":
    main()
