"""Load and fairness: many clients with mixed requests, and a tiny request beside a huge one.

1. Mixed load: `--clients` concurrent clients (default 64), each sending `--per-client` requests
   (default 15) one after another, cycling through completions, chat, streaming completions,
   streaming chat and scoring (`allowed_token_ids`, logprobs, token-id prompt), all greedy.
   Every answer is compared with the same request's answer when it ran alone before the load:
   lost (no answer), duplicated (more than one end for a choice), 5xx and wrong are counted;
   p50 / p99 latency per kind.
2. Fairness: a tiny completion's latency alone, then while one /v1/completions request with
   `--big-prompts` prompts (default 10,000, max_tokens 1) runs; the server is started with
   `--max-prompts-per-request` at least that large.

The default model (SmolLM2-135M-Instruct), float32.

    python scripts/bench_load.py                 # about 3-5 minutes on 2 cores
    python scripts/bench_load.py --quick
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Water boils at",
           "The best way to learn is", "In 1969, humans"]
KINDS = ["completion", "chat", "completion-stream", "chat-stream", "scoring"]


def request_of(i: int, tokenizer) -> tuple[str, str, dict]:
    """(kind, path, body) of the i-th distinct request."""
    kind, prompt = KINDS[i % len(KINDS)], PROMPTS[i % len(PROMPTS)]
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0}
    completion = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    if kind == "scoring":
        labels = tokenizer.encode(" Yes No", add_special_tokens=False)
        body = {"prompt": tokenizer.encode(f"{prompt}? Answer Yes or No:"), "max_tokens": 1,
                "temperature": 0, "logprobs": 2, "allowed_token_ids": labels,
                "return_tokens_as_token_ids": True}
        return kind, "/v1/completions", body
    if kind.startswith("chat"):
        return kind, "/v1/chat/completions", {**chat, "stream": kind.endswith("stream")}
    return kind, "/v1/completions", {**completion, "stream": kind.endswith("stream")}


async def answer(client, path: str, body: dict) -> tuple[int, str, int]:
    """(status, the answer's text or label, number of finish markers seen)."""
    if not body.get("stream"):
        r = await client.post(path, json=body)
        if r.status_code != 200:
            return r.status_code, r.text, 0
        choice = r.json()["choices"][0]
        if "logprobs" in body and isinstance(body["logprobs"], int):
            text = json.dumps(choice["logprobs"]["top_logprobs"][0], sort_keys=True)
        else:
            text = choice.get("text", (choice.get("message") or {}).get("content"))
        return 200, text, int(choice["finish_reason"] is not None)
    parts, finishes, done = [], 0, 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode(), 0
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                for choice in event.get("choices", []):
                    parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                    finishes += choice.get("finish_reason") is not None
    return 200, "".join(parts), finishes if done == 1 else finishes + 1


async def mixed_load(url: str, tokenizer, clients: int, per_client: int) -> None:
    import httpx

    distinct = [request_of(i, tokenizer) for i in range(len(KINDS) * len(PROMPTS))]
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        reference = [(await answer(client, path, body))[1] for _, path, body in distinct]
        stats = {"lost": 0, "duplicated": 0, "5xx": 0, "4xx": 0, "wrong": 0, "ok": 0}
        latencies: dict[str, list[float]] = {k: [] for k in KINDS}

        async def one_client(c: int) -> None:
            for j in range(per_client):
                i = (c * per_client + j) % len(distinct)
                kind, path, body = distinct[i]
                t0 = time.perf_counter()
                try:
                    status, text, finishes = await answer(client, path, body)
                except httpx.HTTPError:
                    stats["lost"] += 1
                    continue
                latencies[kind].append(time.perf_counter() - t0)
                if status >= 500:
                    stats["5xx"] += 1
                elif status >= 400:
                    stats["4xx"] += 1
                elif finishes != 1:
                    stats["duplicated" if finishes > 1 else "lost"] += 1
                elif text != reference[i]:
                    stats["wrong"] += 1
                else:
                    stats["ok"] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    total = clients * per_client
    print(f"\n## Mixed load: {clients} clients x {per_client} requests = {total} in {wall:.1f} s "
          f"({total / wall:.1f} req/s)")
    print("  " + ", ".join(f"{k} {v}" for k, v in stats.items()))
    every = [x for v in latencies.values() for x in v]
    rows = [[k, len(v), bc.ms(bc.percentile(v, 50)), bc.ms(bc.percentile(v, 99))]
            for k, v in [*latencies.items(), ("all", every)] if v]
    bc.print_table("latency per kind", ["kind", "n", "p50", "p99"], rows)


async def fairness(url: str, big_prompts: int, probes: int) -> None:
    import httpx

    tiny = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}
    big = {"prompt": [f"Item {i}:" for i in range(big_prompts)], "max_tokens": 1, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        alone = []
        for _ in range(probes):
            t0 = time.perf_counter()
            (await client.post("/v1/completions", json=tiny)).raise_for_status()
            alone.append(time.perf_counter() - t0)
        t_big = time.perf_counter()
        big_task = asyncio.create_task(client.post("/v1/completions", json=big))
        await asyncio.sleep(1.0)
        beside = []
        while not big_task.done() and len(beside) < probes:
            t0 = time.perf_counter()
            (await client.post("/v1/completions", json=tiny)).raise_for_status()
            beside.append(time.perf_counter() - t0)
            await asyncio.sleep(0.2)
        r = await big_task
        big_s = time.perf_counter() - t_big
    r.raise_for_status()
    assert len(r.json()["choices"]) == big_prompts
    a, b = statistics.median(alone), statistics.median(beside) if beside else float("nan")
    print(f"\n## Fairness: the {big_prompts}-prompt request took {big_s:.1f} s")
    bc.print_table("tiny request latency", ["", "n", "median", "max", "vs alone"], [
        ["alone", len(alone), bc.ms(a), bc.ms(max(alone)), "1.00x"],
        [f"beside {big_prompts} prompts", len(beside), bc.ms(b),
         bc.ms(max(beside)) if beside else "-", bc.ratio(b, a)],
    ])


def main() -> None:
    p = bc.base_parser(__doc__.splitlines()[0], repeats=False)
    p.add_argument("--clients", type=int, default=None, help="concurrent clients; default 64, 8 with --quick")
    p.add_argument("--per-client", type=int, default=15, help="requests per client")
    p.add_argument("--big-prompts", type=int, default=None,
                   help="prompts in the huge request; default 10000, 500 with --quick")
    args = p.parse_args()
    bc.setup(args)
    clients = args.clients or (8 if args.quick else 64)
    big = args.big_prompts or (500 if args.quick else 10_000)
    tokenizer = bc.load_tokenizer()
    with bc.freetoken_server("--max-prompts-per-request", str(big),
                             threads=args.threads) as server:
        asyncio.run(mixed_load(server.url, tokenizer, clients, args.per_client))
        asyncio.run(fairness(server.url, big, probes=5 if args.quick else 10))


if __name__ == "__main__":
    main()
