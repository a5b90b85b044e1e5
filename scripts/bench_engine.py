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
The MoE table (`--tables moe`, not in the default set) runs the engine table on a Qwen3-MoE built
from a config with random weights (MOE_CONFIG: 258M parameters, 64 experts, top 8, ~50M active
per token), in each of --moe-dtypes (bfloat16 up to batch 8), against HF transformers on the
same folder (its default experts implementation), and notes the experts' share of a decode step
and the part of it spent outside the expert GEMMs (routing, sorting, gathering, padding, the
activation, the weighted sum); about 4 minutes with --quick on 2 busy cores.
`--tables hybrid` (not in the default run): the engine table on a Qwen3.5-shaped hybrid with
random weights (HYBRID_SHAPE: Qwen3.5-0.8B's widths, 8 layers, 3 of 4 Gated DeltaNet, the
248k vocabulary; about 420M parameters), HF transformers on its torch fallback for the delta
rule, then the prefix cache's gain on the scoring B scenario (a shared 400-token prefix, 8
items of 24 tokens, max_tokens 1, the cache warmed with one item) against no cache.
`--tables speculative` (not in the default run): decode with prompt-lookup speculation against
plain decoding, on a copy-heavy workload and on free generation (scripts/_bench_speculative.py);
`--speculative-method mtp --speculative-model FOLDER` drafts with a checkpoint's MTP head.
`--tables quantized` (not in the default run): a GGUF's blocks kept quantized (the default model's,
or --quantized-models 8b: a synthetic Qwen3-8B) against our float32 and bfloat16 runs on them
dequantized, and llama.cpp where installed, with memory (scripts/_bench_quantized.py);
scripts/bench_gguf_load.py measures loading a real-size GGUF.
`--tables families` (not in the default run): decode at batch 1 and 8 of every family served, on
random models of one shape with each family's quirks on, against HF (scripts/_bench_families.py).

    python scripts/bench_engine.py                 # float32, about 2-3 minutes on 2 cores
    python scripts/bench_engine.py --quick
    python scripts/bench_engine.py --tables processors   # one table (no HF: no engine table)
    python scripts/bench_engine.py --tables grammar
    python scripts/bench_engine.py --tables hybrid --repeats 1   # about 3-4 minutes on 2 cores
    python scripts/bench_engine.py --dtype bfloat16
    python scripts/bench_engine.py --tables moe    # the MoE table alone, float32 and bfloat16
    python scripts/bench_engine.py --profile       # also: where a decode step's time goes
    python scripts/bench_engine.py --tables speculative   # about 2 minutes on 2 cores
    python scripts/bench_engine.py --tables quantized --quick
    python scripts/bench_engine.py --tables families --quick   # decode per family (_bench_families.py)
    python scripts/bench_engine.py --tables quantized --quick --skip-hf --llama-python /tmp/llamavenv/bin/python
    python scripts/bench_engine.py --tables quantized --quick --quantized-models 8b --llama-cpp-bin BIN
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
from _bench_families import families_table  # noqa: E402
from _bench_quantized import quantized_table  # noqa: E402
from _bench_speculative import speculative_table  # noqa: E402

from freetoken.config import EngineConfig, ParallelConfig  # noqa: E402
from freetoken.core import SamplingParams, StructuredSpec  # noqa: E402
from freetoken.engine.parallel import load_rank, share_cores  # noqa: E402
from freetoken.scheduler.factory import build_scheduler  # noqa: E402
from freetoken.message import UserMsg  # noqa: E402
import freetoken.layers.moe as moe  # noqa: E402
from freetoken.models.registry import load_model  # noqa: E402
from freetoken.scheduler.worker import rank_main  # noqa: E402
from freetoken.tokenizer.tokenize import bad_words_token_ids  # noqa: E402


class Ours:
    def __init__(self, dtype: str, kv_slots: int, model: Path | None = None,
                 prefix_cache: bool = False, tp_size: int = 1):
        # No prefix cache unless asked: repeats reuse prompts, and a cache hit would skip the
        # prefill we time (bench_scoring.py and the hybrid table measure the cache).
        config = EngineConfig(model_folder=str(model) if model else None, dtype=dtype, device="cpu",
                              kv_slots=kv_slots, prefix_cache=prefix_cache,
                              parallel=ParallelConfig(tp_size=tp_size, master_port=bc.free_port()))
        self.group, self.ranks = None, []
        if tp_size == 1:
            self.loaded = load_model(model, dtype=dtype, device="cpu")
        else:
            self.ranks = start_ranks(config)
            self.loaded, self.group = load_rank(config, 0)
        self.scheduler = build_scheduler(self.loaded, config, self.group)
        bc.kernel_heading(self.loaded)
        if self.group:
            self.group.setup_barrier()
            for ready, _ in self.ranks:
                assert ready.recv() == "ok"
        self.uid = 0

    @classmethod
    def on(cls, loaded, kv_slots: int) -> Ours:
        """Ours on a model already loaded (one process, no tensor parallelism)."""
        ours = cls.__new__(cls)
        ours.group, ours.ranks, ours.loaded, ours.uid = None, [], loaded, 0
        ours.scheduler = build_scheduler(loaded, kv_slots=kv_slots, prefix_cache=False)
        return ours

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
    def __init__(self, dtype: str, model: Path | None = None):
        self.model, self.tokenizer = bc.load_hf(dtype, model)

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
                   help="tables to print, comma-separated (also: moe, hybrid, speculative, quantized, families)")
    p.add_argument("--speculative-tokens", type=int, default=4,
                   help="draft length of the speculative table")
    p.add_argument("--speculative-method", default="ngram", choices=["ngram", "mtp"],
                   help="drafts of the speculative table: prompt lookup, or the model's MTP head")
    p.add_argument("--speculative-model", default=None,
                   help="model folder of the speculative table (default: the default model; mtp "
                   "needs a checkpoint with an MTP head, e.g. Qwen3.5)")
    p.add_argument("--moe-dtypes", default="float32,bfloat16", help="dtypes of the MoE table")
    p.add_argument("--kv-slots", type=int, default=16384, help="our KV pool, in tokens")
    p.add_argument("--profile", action="store_true",
                   help="profile our decode steps at batch 1 and 32 (torch.profiler + cProfile)")
    p.add_argument("--skip-hf", action="store_true", help="our engine only (no ratios)")
    p.add_argument("--llama-python", default=None,
                   help="the interpreter that has llama-cpp-python, for the quantized table's llama.cpp "
                        "row (default $FREETOKEN_LLAMA_PYTHON, else this one)")
    p.add_argument("--llama-cpp-bin", default=None,
                   help="a llama.cpp build's bin folder: the quantized table runs its llama-batched-bench "
                        "at every batch (default $FREETOKEN_LLAMA_CPP_BIN; else llama-cpp-python)")
    p.add_argument("--llama-cpp-args", default="",
                   help="extra arguments to llama-batched-bench (e.g. '--no-repack')")
    p.add_argument("--quantized-models", default="default",
                   help="the quantized table's GGUFs, comma-separated: default (the default model's), "
                        "8b, 30b-a3b, gpt-oss-20b (synthetic Q4_K_M / MXFP4 files of those shapes, 4.1, 17.3, "
                        "11.3 GiB, written under the cache once) "
                        "or a path")
    p.add_argument("--quantized-arithmetic", default="exact",
                   help="the quantized table's runs of ours on the blocks: exact, int8 or both (comma-separated)")
    p.add_argument("--dequantized-dtypes", default="float32,bfloat16",
                   help="the quantized table's runs of ours on the blocks dequantized at load")
    p.add_argument("--dequantized-max-gib", type=float, default=8.0,
                   help="skip a dequantized run whose weights would hold more than this")
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
    known = {"engine", "logprobs", "processors", "grammar", "moe", "hybrid", "tp", "speculative", "quantized",
             "families"}
    assert tables <= known, f"unknown tables: {args.tables}"
    prefill_len = args.prefill_len or (64 if args.quick else 128)
    new_tokens = args.new_tokens or (16 if args.quick else 32)
    print(f"# dtype {args.dtype}; prefill prompts of {prefill_len} tokens; decode {new_tokens} "
          f"new tokens after {args.decode_prompt_len}-token prompts; greedy, ignore_eos")
    if "moe" in tables:
        moe_tables(batches, prefill_len, new_tokens, args)
    if "hybrid" in tables:
        hybrid_tables(args, batches)
    if "speculative" in tables:
        speculative_table(load_model(args.speculative_model, dtype=args.dtype, device="cpu"), args)
    if "quantized" in tables:
        quantized_table(Ours, batches, prefill_len, new_tokens, args)
    if "families" in tables:
        families_table(Ours, HF, args)
    tables -= {"moe", "hybrid", "speculative", "quantized", "families"}
    if not tables:
        return

    ours = Ours(args.dtype, args.kv_slots)
    tok = ours.loaded.tokenizer
    n = max(batches + [args.logprobs_batch, args.processors_batch, args.grammar_batch])
    pre_prompts = bc.token_prompts(tok, n, prefill_len, seed=1)
    dec_prompts = bc.token_prompts(tok, n, args.decode_prompt_len, seed=2)
    # TP=1 first, with every thread: the ranks of a group must not wait on it (their timeout).
    baseline = tp_baseline(ours, batches, pre_prompts, dec_prompts, new_tokens, args) \
        if "tp" in tables else None
    if tp > 1:
        ours = Ours(args.dtype, args.kv_slots, tp_size=tp)

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
                 dec_prompts: list[list[int]], prefill_len: int, new_tokens: int, args,
                 title: str = "Engine vs HF transformers") -> None:
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
        f"{title}, {str(ours.loaded.dtype).removeprefix('torch.')} (tokens/s; ratio = ours / HF)",
        ["batch", "prefill ours", "prefill HF", "ratio", "decode ours", "decode HF", "ratio",
         "ours ms/step"], rows)


# Qwen3-30B-A3B's shape scaled down: 64 experts, top 8, renormalised; the default model's vocabulary.
MOE_CONFIG = dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
                  num_hidden_layers=8, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  max_position_embeddings=4096, tie_word_embeddings=False)


def moe_folder() -> Path:
    """MOE_CONFIG with random weights (seed 0) as an HF folder, built once."""
    import shutil

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from freetoken.paths import cache_root

    folder = cache_root() / "bench-models" / "qwen3-moe-random-v1"
    if (folder / "config.json").is_file():
        return folder
    tokenizer = bc.load_tokenizer()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), **MOE_CONFIG)
    tmp = folder.with_name(folder.name + ".tmp")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)
    return folder


# Qwen3.5-0.8B's widths with 8 of its 24 layers (the pattern: 3 Gated DeltaNet, 1 full attention).
HYBRID_SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                    linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True,
                    max_position_embeddings=32768)


def hybrid_folder() -> Path:
    """The random Qwen3.5-shaped model, built once (on the Qwen3.5 tokenizer of the tests)."""
    from freetoken.paths import cache_root

    folder = cache_root() / "bench-models" / "qwen3_5-random-425m-v1"
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.fixtures.build_models import write_qwen35_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**HYBRID_SHAPE), dtype=torch.float32)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    write_qwen35_tokenizer(tmp)
    tmp.replace(folder)
    return folder


def moe_tables(all_batches: list[int], prefill_len: int, new_tokens: int, args) -> None:
    folder = moe_folder()
    for dtype in bc.parse_dtypes(args.moe_dtypes):
        # bfloat16 GEMMs are slow on CPUs without native bf16: its rows stop at batch 8.
        batches = [b for b in all_batches if dtype == "float32" or b <= 8] or all_batches[:1]
        ours = Ours(dtype, args.kv_slots, folder)
        tok = ours.loaded.tokenizer
        pre_prompts = bc.token_prompts(tok, max(batches), prefill_len, seed=1)
        dec_prompts = bc.token_prompts(tok, max(batches), args.decode_prompt_len, seed=2)
        ours.prefill(pre_prompts[:8])
        ours.decode(dec_prompts[:8], 4)
        hf = None
        if not args.skip_hf:
            hf = HF(dtype, folder)
            hf.prefill(pre_prompts[:8])
            hf.generate(dec_prompts[:8], 4)
        params = sum(p.numel() for p in hf.model.parameters()) if hf else None
        title = (f"Qwen3-MoE ({params / 1e6:.0f}M params, " if params else "Qwen3-MoE (")
        stacked = any(m.stacked for m in ours.loaded.model.modules() if isinstance(m, moe.Experts))
        title += "64 experts, top 8), ours on " + ("the grouped kernel" if stacked else "packed Linears")
        title += " vs HF transformers"
        if hf:
            title += f" (experts: {hf.model.config._experts_implementation})"
        engine_table(ours, hf, batches, pre_prompts, dec_prompts, prefill_len, new_tokens, args, title)
        for b in sorted({min(8, max(batches)), max(batches)}):
            experts_share(ours, dec_prompts[:b], new_tokens)
        del ours, hf


def experts_share(ours: Ours, prompts: list[list[int]], new_tokens: int) -> None:
    """Note the experts' share of our decode steps at this batch, timed by module hooks (in a
    run of its own: the hooks add a little time), and the part of it in their GEMMs (the grouped
    kernel's calls, or the per-expert Linears where the kernel does not run)."""
    spent = {"experts": 0.0, "gemms": 0.0}
    handles = []

    def timed(module, key):
        def pre(*_):
            module._t0 = time.perf_counter()

        def post(*_):
            spent[key] += time.perf_counter() - module._t0

        handles.extend([module.register_forward_pre_hook(pre), module.register_forward_hook(post)])

    kernel = moe.grouped_gemm

    def timed_kernel(*args):
        t0 = time.perf_counter()
        out = kernel(*args)
        spent["gemms"] += time.perf_counter() - t0
        return out

    moe.grouped_gemm = timed_kernel
    for module in ours.loaded.model.modules():
        if isinstance(module, moe.Experts):
            timed(module, "experts")
            for expert in module.experts or []:
                timed(expert.gate_up_proj, "gemms")
                timed(expert.down_proj, "gemms")
    # Only the decode steps count: the prompts are added and prefilled before the hooks count.
    ours._add(prompts, new_tokens)
    started: set[int] = set()
    while len(started) < len(prompts):
        started |= {m.uid for m in ours.scheduler.step()}
    spent.update(experts=0.0, gemms=0.0)
    steps, t0 = 0, time.perf_counter()
    while ours.scheduler.has_work:
        ours.scheduler.step()
        steps += 1
    t = time.perf_counter() - t0
    for h in handles:
        h.remove()
    moe.grouped_gemm = kernel
    bc.note(f"batch {len(prompts)}: decode {bc.ms(t / steps)} ms/step (hooked); experts "
            f"{spent['experts'] / t:.0%} of it, and of the experts' time "
            f"{(spent['experts'] - spent['gemms']) / max(spent['experts'], 1e-9):.0%} outside "
            "their GEMMs (routing, sort, gather, padding, activation, weighted sum)")


def hybrid_tables(args, batches: list[int]) -> None:
    prefill_len = args.prefill_len or 64
    new_tokens = args.new_tokens or 16
    folder = hybrid_folder()
    ours = Ours(args.dtype, args.kv_slots, folder)
    tok = ours.loaded.tokenizer
    pre_prompts = bc.token_prompts(tok, max(batches), prefill_len, seed=1)
    dec_prompts = bc.token_prompts(tok, max(batches), args.decode_prompt_len, seed=2)
    ours.prefill(pre_prompts[:2])
    ours.decode(dec_prompts[:2], 2)
    hf = None if args.skip_hf else HF(args.dtype, folder)
    if hf:
        hf.prefill(pre_prompts[:2])
        hf.generate(dec_prompts[:2], 2)
    params = sum(p.numel() for p in hf.model.parameters()) if hf else None
    engine_table(ours, hf, batches, pre_prompts, dec_prompts, prefill_len, new_tokens, args,
                 f"Random Qwen3.5-shaped hybrid ({bc.fmt(params / 1e6 if params else None)}M "
                 "parameters) vs HF transformers")
    del hf, ours  # one model in memory at a time: the machine is shared
    prefix = bc.token_prompts(tok, 1, 400, seed=3)[0]
    items = [prefix + ids for ids in bc.token_prompts(tok, 9, 24, seed=4)]
    rows, times = [], {}
    for name, cache in (("off", False), ("on", True)):
        side = Ours(args.dtype, args.kv_slots, folder, prefix_cache=cache)
        side.prefill(items[:1])  # warms the cache with the prefix (and the kernels)
        times[name] = bc.best_time(lambda s=side: s.prefill(items[1:]), args.repeats)
        stats = side.scheduler.stats()
        rows.append([name, len(items[1:]) / times[name], bc.ratio(times["off"], times[name]),
                     stats["state_snapshots"]])
        del side
    bc.print_table(f"Prefix cache on the hybrid: 8 items behind a shared 400-token prefix, "
                   f"max_tokens 1, {args.dtype} (gain = time off / time on)",
                   ["prefix cache", "items/s", "gain", "snapshots held"], rows)
    bc.note(f"recurrent state per request (and per snapshot): "
            f"{stats['state_bytes_per_slot'] / 2**20:.1f} MiB")


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
