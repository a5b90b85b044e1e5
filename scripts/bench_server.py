"""Server overhead: `freetoken serve` under 1, 8 and 32 concurrent clients vs the offline API.

The same requests (distinct ~32-token prompts, /v1/completions, max_tokens 16, temperature 0)
go once through HTTP to a `freetoken serve` subprocess (httpx + asyncio clients, each sending its
next request when the previous one is answered) and once through the offline `freetoken.LLM` in
this process (`generate` over groups of `concurrency` prompts). Both use the same dtype, threads
and KV pool size, prefix cache on (the default; every prompt is new to both). The ratio server /
offline is what HTTP, JSON, tokenization, the ZMQ hop and the separate processes cost.
Each level runs once (a repeat would hit the prefix cache).

Metrics overhead, same run: the server always observes its Prometheus metrics, so the cost is
measured as what observing adds to one request of this shape (the very calls the server makes per
request and per engine message, timed in this process), set against the server's time per
request at each level; and a `/metrics` scrape of the loaded server, whose counters must equal
the requests and tokens sent.

    python scripts/bench_server.py              # about 2-3 minutes on 2 cores
    python scripts/bench_server.py --quick
"""

from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402

from freetoken import LLM, SamplingParams  # noqa: E402


def offline(llm: LLM, prompts: list[str], concurrency: int, max_tokens: int):
    """(wall seconds, per-request latencies, texts) through `LLM.generate` in groups."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    latencies, texts = [], []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        group = prompts[i : i + concurrency]
        g0 = time.perf_counter()
        outs = llm.generate(group, params)
        latencies += [time.perf_counter() - g0] * len(group)
        texts += [o.text for o in outs]
    return time.perf_counter() - t0, latencies, texts


def observe_cost_us(prompt_tokens: int, tokens: int, requests: int = 3000) -> float:
    """Microseconds that metrics add to one request: its timer, one observation per engine
    message (one token per step), the finish, and the HTTP counter."""
    from freetoken.serving.metrics import Metrics, RequestTimer

    metrics = Metrics("bench", dict)
    t0 = time.perf_counter()
    for _ in range(requests):
        timer = RequestTimer()
        metrics.on_tokens(timer, prompt_tokens, 1)
        for _ in range(tokens - 1):
            metrics.on_tokens(timer, 0, 1)
        metrics.on_finish(timer, "length")
        metrics.http_requests.labels("/v1/completions", "200").inc()
    return (time.perf_counter() - t0) / requests * 1e6


def detokenize_cost_us(tokenizer, ids: list[int], requests: int = 300) -> float:
    """Microseconds the frontend spends turning one request's messages (one token each) into
    replies: the per-token work that observing sits beside."""
    from freetoken.message import DetokenizeMsg
    from freetoken.tokenizer.reply import ReplyBuilder

    t0 = time.perf_counter()
    for _ in range(requests):
        builder = ReplyBuilder(tokenizer, [])
        for i, token in enumerate(ids):
            builder.build(DetokenizeMsg(0, token_ids=[token], logprobs=[None],
                                        finished=i == len(ids) - 1))
    return (time.perf_counter() - t0) / requests * 1e6


def scrape(url: str, times: int = 20) -> tuple[float, dict[str, float]]:
    """(seconds per GET /metrics, {sample name with labels: value}) of the running server."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    t0 = time.perf_counter()
    for _ in range(times):
        text = httpx.get(url + "/metrics", timeout=30).text
    per_scrape = (time.perf_counter() - t0) / times
    values = {s.name + str(sorted((k, v) for k, v in s.labels.items() if k != "model_name")):
              s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return per_scrape, values


def main() -> None:
    p = bc.base_parser(__doc__.split("\n")[0], repeats=False)
    p.add_argument("--dtype", default="float32", choices=list(bc.DTYPES), help="both sides")
    p.add_argument("--concurrency", default="1,8,32", help="client counts, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=32, help="approximate prompt length")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request")
    p.add_argument("--requests-per-client", type=int, default=None,
                   help="requests = clients x this, at least 16 (8 with --quick); default 4, "
                        "quick 2")
    p.add_argument("--kv-cache-tokens", type=int, default=16384,
                   help="KV pool of both sides, in tokens (the server's default, 65536, takes "
                        "about 3 GB in float32)")
    args = p.parse_args()
    bc.setup(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    per_client = args.requests_per_client or (2 if args.quick else 4)
    counts = {c: max(8 if args.quick else 16, c * per_client) for c in levels}

    tokenizer = bc.load_tokenizer()
    rng = random.Random(0)
    prompts = {c: [bc.text_of_tokens(tokenizer, args.prompt_tokens, rng, f"Request {c}-{i}:")
                   for i in range(counts[c])] for c in levels}
    warmup = [bc.text_of_tokens(tokenizer, args.prompt_tokens, rng, f"Warm-up {i}:")
              for i in range(8)]
    print(f"# dtype {args.dtype}; ~{args.prompt_tokens}-token prompts, max_tokens "
          f"{args.max_tokens}, temperature 0; requests per level {counts}")

    # Offline first, then free it: only one copy of the model and KV pool in memory at a time.
    llm = LLM(dtype=args.dtype, kv_slots=args.kv_cache_tokens)
    offline(llm, warmup, 8, args.max_tokens)
    off = {c: offline(llm, prompts[c], c, args.max_tokens) for c in levels}
    del llm
    gc.collect()

    on = {}
    with bc.freetoken_server("--dtype", args.dtype, "--kv-cache-tokens", str(args.kv_cache_tokens),
                             threads=args.threads) as server:
        url = server.url + "/v1/completions"

        def payloads(texts: list[str]) -> list[dict]:
            return [{"prompt": t, "max_tokens": args.max_tokens, "temperature": 0} for t in texts]

        bc.run_load(url, payloads(warmup), 8)
        for c in levels:
            on[c] = bc.run_load(url, payloads(prompts[c]), c)
        scrape_s, scraped = scrape(server.url)

    rows = []
    for c in levels:
        wall, lat, texts = off[c]
        res = on[c]
        same = sum(r["choices"][0]["text"] == t for r, t in zip(res.responses, texts))
        off_rps = len(texts) / wall
        rows.append([c, res.n, res.rps, bc.ms(res.p50), bc.ms(res.p99), off_rps,
                     bc.ms(bc.percentile(lat, 50)), bc.ms(bc.percentile(lat, 99)),
                     bc.ratio(res.rps, off_rps), res.usage_sum("completion_tokens") / res.wall_s,
                     f"{same}/{res.n}"])
    bc.print_table(
        f"Server vs offline LLM, {args.dtype} (requests/s, latency ms; ratio = server / offline)",
        ["clients", "requests", "server req/s", "p50", "p99", "offline req/s", "p50", "p99",
         "ratio", "server out tok/s", "same text"], rows)
    bc.load_note()
    bc.note("\nOffline latency is the wall time of the generate() call that held the request "
            "(a group of `clients` prompts).")

    sent = len(warmup) + sum(counts.values())
    got = scraped.get("freetoken:http_requests_total[('endpoint', '/v1/completions'), "
                      "('status', '200')]")
    tokens = sum(on[c].usage_sum("completion_tokens") for c in levels)
    cost = observe_cost_us(args.prompt_tokens, args.max_tokens)
    output_ids = tokenizer.encode(on[levels[0]].responses[0]["choices"][0]["text"],
                                  add_special_tokens=False)[: args.max_tokens]
    detok = detokenize_cost_us(tokenizer, output_ids)
    rows = [[c, f"{on[c].wall_s / on[c].n * 1e3:,.1f}", f"{cost:.1f}",
             f"{cost / (on[c].wall_s / on[c].n * 1e6) * 100:.3f} %"] for c in levels]
    bc.print_table(f"Metrics overhead: {cost:.1f} us of observing per request "
                   f"({args.max_tokens} tokens), against the server's time per request "
                   "(wall / requests)", ["clients", "server ms/request", "observing us",
                                         "share"], rows)
    bc.note(f"\nThe frontend's detokenizing of the same request takes {detok:.0f} us: observing "
            f"adds {cost / detok * 100:.0f} % to the frontend's per-token work.")
    bc.note(f"\nGET /metrics on the loaded server: {scrape_s * 1000:.1f} ms; it counted {got:.0f} "
            f"completions (sent {sent}) and "
            f"{scraped.get('freetoken:generation_tokens_total[]', 0):.0f} generated tokens "
            f"(measured here {tokens} + warm-up).")


if __name__ == "__main__":
    main()
