"""The speculative table of bench_engine.py (`--tables speculative`): decode tokens/s of the same
requests with and without speculation (prompt lookup, or `--speculative-method mtp` on a
`--speculative-model` with an MTP head), in the same process on the same weights, runs of the
two interleaved, with the drafts' acceptance rate.

Workloads, each at 1 and 8 clients:
  copy: the chat template around "copy this text" and a passage (code, prose), greedy, until the
        model stops or max tokens: the output repeats the prompt, as a rewrite or a code edit does;
  free: free generation from a story opening, sampled (temperature 0.8, seeded), ignore_eos.
Outputs are checked equal (they must be: docs/engine/speculative.md, "Speculative decoding").
Each run builds its own scheduler, so the speculative side's measured choice of drafting or plain steps
(scheduler/speculation.py, `ModeChoice`) starts over each run: its warm-up weighs more on these
48- or 96-token runs than on a server, which keeps it across requests.
"""

from __future__ import annotations

import statistics
import time

import _bench_common as bc

from freetoken.config import SpeculativeConfig
from freetoken.core import SamplingParams
from freetoken.message import UserMsg
from freetoken.scheduler.factory import build_scheduler

PASSAGES = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\ndef spread(values):\n    m = mean(values)\n"
    "    return max(values) - min(values), m\n",
    "The river runs past the old mill, under the stone bridge and into the town, where the "
    "market opens at seven and the baker sells bread until the last loaf is gone.",
]


def _copy_prompts(tok, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        text = PASSAGES[i % len(PASSAGES)]
        messages = [{"role": "user", "content": f"Copy this text exactly ({i}):\n{text}"}]
        prompts.append(list(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)))
    return prompts


def _run(loaded, prompts, params, speculative) -> tuple[float, int, dict, list]:
    """(decode seconds, tokens after each request's first, stats, outputs)."""
    scheduler = build_scheduler(loaded, kv_slots=16384, prefix_cache=False, speculative=speculative)
    for uid, ids in enumerate(prompts):
        scheduler.add(UserMsg(uid, ids, params()))
    outputs: dict[int, list[int]] = {}
    while len(outputs) < len(prompts):  # every request's prefill and first token
        for msg in scheduler.step():
            outputs.setdefault(msg.uid, []).extend(msg.token_ids)
    first = sum(len(v) for v in outputs.values())
    t0 = time.perf_counter()
    while scheduler.has_work:
        for msg in scheduler.step():
            outputs[msg.uid].extend(msg.token_ids)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(v) for v in outputs.values()) - first, scheduler.stats(), outputs


def speculative_table(loaded, args) -> None:
    """Each row: plain and speculative runs interleaved in pairs (the pair's order alternating, so
    that a drift of the machine's speed weighs on both), at least 3 pairs; the ratio is each
    pair's, its median and spread printed, tokens/s the medians."""
    tok = loaded.tokenizer
    spec = SpeculativeConfig(num_speculative_tokens=args.speculative_tokens, method=args.speculative_method)
    new_tokens = 48 if args.quick else 96
    pairs = max(args.repeats, 3)
    workloads = {
        "copy": (_copy_prompts, lambda: SamplingParams(temperature=0, max_tokens=new_tokens)),
        "free": (lambda t, n: bc.token_prompts(t, n, 24, seed=3),
                 lambda: SamplingParams(temperature=0.8, seed=7, max_tokens=new_tokens,
                                        ignore_eos=True)),
    }
    rows = []
    for name, (make_prompts, params) in workloads.items():
        for clients in (1, 8):
            prompts = make_prompts(tok, clients)
            _run(loaded, prompts[:1], params, spec)  # warm-up: kernels, first-call allocations
            _run(loaded, prompts[:1], params, None)
            plain, drafted = [], []
            for pair in range(pairs):
                order = [(plain, None), (drafted, spec)][:: 1 if pair % 2 == 0 else -1]
                for runs, config in order:
                    runs.append(_run(loaded, prompts, params, config))
            assert all(d[3] == plain[0][3] for d in plain + drafted), f"{name}: speculation changed an output"
            ratios = sorted((d[1] / d[0]) / (p[1] / p[0]) for p, d in zip(plain, drafted))
            # Summed over the speculative runs: the cost model's decisions follow each run's timing.
            stats = {k: sum(d[2][k] for d in drafted) for k in drafted[0][2] if k.startswith("spec_decode_num")}
            proposed = stats["spec_decode_num_draft_tokens"]
            accepted = stats["spec_decode_num_accepted_tokens"]
            rows.append([name, clients, statistics.median(p[1] / p[0] for p in plain),
                         statistics.median(d[1] / d[0] for d in drafted),
                         f"{statistics.median(ratios):.2f}x", f"{ratios[0]:.2f}-{ratios[-1]:.2f}",
                         f"{accepted / proposed:.2f}" if proposed else "-",
                         f"{(stats['spec_decode_num_emitted_tokens'] / stats['spec_decode_num_drafts']):.2f}"
                         if stats["spec_decode_num_drafts"] else "-"])
    bc.print_table(
        f"Speculative decoding ({spec.method}, k={spec.num_speculative_tokens}) vs plain, "
        f"{str(loaded.dtype).removeprefix('torch.')}, {pairs} interleaved pairs "
        f"(decode tokens/s, medians; outputs equal)",
        ["workload", "clients", "plain", "speculative", "ratio", "ratio range", "accepted",
         "tokens/verify"], rows)
    bc.load_note()
