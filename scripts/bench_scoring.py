"""Classifier scoring and chat decode through `freetoken serve`, vs HF transformers (and llama.cpp).

Scenarios (all on the default model, same threads on every side, one run):
  A  256 distinct ~40-token prompts, /v1/completions, max_tokens 1, temperature 0, logprobs 2,
     allowed_token_ids = [" Yes", " No"] (label masks on; off = the same without the mask),
     16 concurrent HTTP clients. Peers: HF transformers scoring the same prompts in-process
     (left-padded batches, logits of the last position only, log_softmax over the two labels),
     and llama.cpp's server on the same GGUF when it is installed.
  B  the same kind of items behind a shared ~400-token instruction prefix: a default server
     (prefix cache on, warmed with the prefix) vs one started with --no-prefix-cache. Peers: HF
     recomputing the prefix in every batch, and HF reusing the prefix's KV (DynamicCache).
  C  chat decode: /v1/chat/completions, 64 new tokens (ignore_eos), temperature 0, at 1, 8 and 32
     concurrent clients, vs HF `generate` over a batch of the same size.
  R  rerank: /v1/rerank of 64 documents (~40 tokens) under one query, the model served as a
     Qwen3-Reranker-style reranker (examples/qwen3_reranker.jinja, labels "no" / "yes"), one
     client, a new query per request; prefix cache on (the query's prefix shared by its
     documents) and off; /score of the same pairs (cache on). Peer: HF scoring the same 64
     rendered prompts in one left-padded batch.
  E  embeddings: /v1/embeddings of 64 inputs (~40 tokens) in one request, a new set per request,
     one client (--runner pooling: last-token pooling, normalised). Peer: HF's final-norm hidden
     states of the same inputs in one left-padded batch, last position, normalised.
  L  whole labels: 256 prompts (--quick: 64) x 4 labels of 1-4 tokens through
     /generative_scoring (one request), against the same totals from one /v1/completions
     request per (prompt, label) (echo, max_tokens 0, logprobs 0: what clients do today; 16
     clients), and against HF teacher-forcing every prompt + label in left-padded batches
     (--hf-batch).
R and E run on --pooling-model: the default model, or `tiny`, the tests' tiny Qwen3 fixtures
(tiny-qwen3 as the reranker, tiny-qwen3-embedding as the embedder), where the per-request
costs around the forward dominate.

Roofline: the best torch GEMM GFLOP/s measured in this run on the model's projection shapes.
Model cost: 2 * n_body FLOPs per computed prompt token (n_body = every matmul weight except the
embedding and the LM head) + 2 * n_head per scored position (the LM head, last position only);
attention's own FLOPs are left out. "% roofline" = useful FLOPs per second / roofline.

    python scripts/bench_scoring.py                          # float32, A,B,C: about 4-5 minutes
    python scripts/bench_scoring.py --quick
    python scripts/bench_scoring.py --dtype bfloat16
    python scripts/bench_scoring.py --dtype float32,bfloat16 --scenarios A,B
    python scripts/bench_scoring.py --scenarios R,E,L --pooling-model tiny
"""

from __future__ import annotations

import copy
import gc
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402

from freetoken.models.registry import load_model  # noqa: E402

QUESTION = "\nQuestion: Is this review positive? Answer:"
LABELS = (" Yes", " No")
ROOT = Path(__file__).resolve().parents[1]
RERANK_TEMPLATE = ROOT / "examples" / "qwen3_reranker.jinja"
RERANK_OVERRIDES = '{"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'
# 1, 2, 3 and 4 tokens on the default model's vocabulary.
LABEL_SET = (" positive", " possibly positive", " hard to say", " not sure at all")
TOPICS = ("a lighthouse", "a lost key", "the first snow", "a robot gardener", "an old map",
          "a night train", "a quiet library", "a paper boat")


@dataclass
class Setup:
    roofline: float  # GFLOP/s
    body: int  # matmul weights per token, embedding and LM head excluded
    head: int  # LM head weights

    def flops(self, computed_tokens: int, scored_rows: int) -> float:
        return 2 * self.body * computed_tokens + 2 * self.head * scored_rows

    def pct_roofline(self, computed_tokens: int, scored_rows: int, seconds: float) -> str:
        gflops = self.flops(computed_tokens, scored_rows) / seconds / 1e9
        return f"{100 * gflops / self.roofline:.0f} %"


# ----------------------------------------------------------------------------- prompts


def items(tokenizer, n: int, tag: str, item_tokens: int = 30) -> list[str]:
    """`n` distinct reviews with the yes/no question: about item_tokens + 10 tokens each."""
    rng = random.Random(tag)
    return [bc.text_of_tokens(tokenizer, item_tokens, rng, f"Review {tag}-{i}:") + QUESTION
            for i in range(n)]


def instruction_prefix(tokenizer, n_tokens: int) -> str:
    rng = random.Random("prefix")
    head = ("Instructions: you label product reviews. Answer Yes when the review is positive "
            "and No otherwise. Examples follow.")
    # One newline: "\n\n" before a word tokenizes differently alone than in context, and the
    # HF peer that reuses the prefix's KV tokenizes the prefix alone.
    return bc.text_of_tokens(tokenizer, n_tokens, rng, head) + ".\n"


def score_payloads(prompts: list[str], label_ids: list[int] | None) -> list[dict]:
    base = {"max_tokens": 1, "temperature": 0, "logprobs": 2}
    if label_ids is not None:
        base |= {"allowed_token_ids": label_ids, "return_tokens_as_token_ids": True}
    return [dict(base, prompt=p) for p in prompts]


def chat_messages(n: int, tag: str) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}, "
              f"number {tag}-{i}."}] for i in range(n)]


def chat_payloads(messages: list[list[dict]], new_tokens: int) -> list[dict]:
    return [{"messages": m, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
            for m in messages]


# ----------------------------------------------------------------------------- HF peers


class HFPeer:
    def __init__(self, dtype: str, folder: Path | None = None):
        self.model, self.tok = bc.load_hf(dtype, folder)
        self.tok.padding_side = "left"

    @torch.inference_mode()
    def score(self, prompts: list[str], labels: list[int], batch: int) -> tuple[float, list]:
        """(seconds, per-prompt label logprobs): left-padded batches sorted by length, the last
        position's logits only, log_softmax over the labels."""
        t0 = time.perf_counter()
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list = [None] * len(prompts)
        for s in range(0, len(order), batch):
            idx = order[s : s + batch]
            enc = self.tok([prompts[i] for i in idx], return_tensors="pt", padding=True)
            pos = (enc.attention_mask.cumsum(-1) - 1).clamp_min(0)
            logits = self.model(**enc, position_ids=pos, logits_to_keep=1).logits[:, -1]
            lps = logits[:, labels].float().log_softmax(-1).tolist()
            for i, lp in zip(idx, lps):
                out[i] = lp
        return time.perf_counter() - t0, out

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> tuple[float, list[list[float]]]:
        """(seconds, vectors): one left-padded batch, the final norm's last position, unit length."""
        t0 = time.perf_counter()
        enc = self.tok(texts, return_tensors="pt", padding=True)
        pos = (enc.attention_mask.cumsum(-1) - 1).clamp_min(0)
        hidden = self.model.model(**enc, position_ids=pos).last_hidden_state[:, -1]
        vectors = torch.nn.functional.normalize(hidden.float(), dim=-1).tolist()
        return time.perf_counter() - t0, vectors

    @torch.inference_mode()
    def label_totals(self, prompts: list[list[int]], labels: list[list[int]],
                     batch: int) -> tuple[float, list[list[float]]]:
        """(seconds, per prompt each label's total logprob): every prompt + label teacher-forced,
        left-padded batches sorted by length, the label positions' log-softmax gathered."""
        t0 = time.perf_counter()
        seqs = [(i, j) for i in range(len(prompts)) for j in range(len(labels))]
        seqs.sort(key=lambda s: len(prompts[s[0]]) + len(labels[s[1]]))
        keep = max(len(label) for label in labels) + 1
        out = [[0.0] * len(labels) for _ in prompts]
        pad = self.tok.pad_token_id
        for s in range(0, len(seqs), batch):
            part = seqs[s : s + batch]
            ids = [prompts[i] + labels[j] for i, j in part]
            width = max(map(len, ids))
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=pos,
                                logits_to_keep=keep).logits
            lps = logits[:, :-1].float().log_softmax(-1)
            for row, (i, j) in enumerate(part):
                n = len(labels[j])
                at = torch.arange(keep - 1 - n, keep - 1)
                out[i][j] = lps[row, at, torch.tensor(labels[j])].sum().item()
        return time.perf_counter() - t0, out

    @torch.inference_mode()
    def score_with_prefix(self, prefix: str, suffixes: list[str], labels: list[int],
                          batch: int) -> float:
        """Seconds to score prefix + suffix for every suffix, the prefix's KV computed once and
        repeated over each batch (right-padded suffixes, last real position gathered)."""
        t0 = time.perf_counter()
        p_ids = self.tok(prefix, return_tensors="pt").input_ids
        prefix_cache = self.model(input_ids=p_ids, use_cache=True).cache
        P = p_ids.shape[1]
        self.tok.padding_side = "right"
        try:
            for s in range(0, len(suffixes), batch):
                enc = self.tok(suffixes[s : s + batch], return_tensors="pt", padding=True,
                               add_special_tokens=False)
                b, L = enc.input_ids.shape
                cache = copy.deepcopy(prefix_cache)
                cache.batch_repeat_interleave(b)
                mask = torch.cat([torch.ones(b, P, dtype=enc.attention_mask.dtype),
                                  enc.attention_mask], dim=1)
                hidden = self.model.model(input_ids=enc.input_ids, attention_mask=mask,
                                          position_ids=P + torch.arange(L).expand(b, L),
                                          cache=cache).last_hidden_state
                last = enc.attention_mask.sum(-1) - 1
                logits = self.model.lm_head(hidden[torch.arange(b), last])
                logits[:, labels].float().log_softmax(-1)
        finally:
            self.tok.padding_side = "left"
        return time.perf_counter() - t0

    @torch.inference_mode()
    def generate(self, messages: list[list[dict]], new_tokens: int) -> float:
        texts = [self.tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                 for m in messages]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        self.model.generate(**enc, do_sample=False, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, pad_token_id=self.tok.pad_token_id)
        return time.perf_counter() - t0


# ----------------------------------------------------------------------------- scenarios


def label_logprobs(resp: dict, label_ids: list[int]) -> list[float]:
    top = resp["choices"][0]["logprobs"]["top_logprobs"][0]
    return [top.get(f"token_id:{t}", float("-inf")) for t in label_ids]


def n_tokens(tokenizer, prompts: list[str]) -> int:
    return sum(len(tokenizer.encode(p)) for p in prompts)


class Run:
    """One dtype's pass: its roofline, its HF peer, and the scenarios in turn.

    Each HF measurement runs right after the freetoken measurement it is compared with (the
    server idles meanwhile), so both see the same machine: it is shared, and its load moves.
    """

    def __init__(self, args, dtype: str, tokenizer, label_ids: list[int]):
        self.args, self.dtype, self.tok, self.labels = args, dtype, tokenizer, label_ids
        self.hf = HFPeer(dtype)
        self.hf.score(items(tokenizer, 16, "warm"), label_ids, args.hf_batch)  # warm-up
        body, head = bc.param_counts(self.hf.model)
        peaks = bc.gemm_roofline(dtype)
        self.st = Setup(max(peaks.values()), body, head)
        measured = ", ".join(f"{kernel} {rate:.0f}" for kernel, rate in peaks.items())
        print(f"# roofline = best GEMM measured now ({measured} GFLOP/s): "
              f"{self.st.roofline:.0f} GFLOP/s; model: "
              f"{2 * body / 1e9:.3f} GFLOP per prompt token + {2 * head / 1e9:.3f} GFLOP per "
              f"scored row (attention excluded)")
        self.n = args.items or (64 if args.quick else 256)
        self.n_b_off = args.items_no_cache or (16 if args.quick else 32)
        self.c_counts = {c: (4 if args.quick else 8) if c == 1 else max(c, 16 if args.quick else 32)
                         for c in args.levels}
        self.a_items = items(tokenizer, self.n, "A")
        self.prefix = instruction_prefix(tokenizer, args.prefix_tokens)
        self.b_items = items(tokenizer, self.n, "B")
        self.llama: dict = {}

    def server(self, *extra: str, name: str) -> bc.Server:
        return bc.freetoken_server("--dtype", self.dtype, "--kv-cache-tokens",
                                   str(self.args.kv_cache_tokens), *extra,
                                   threads=self.args.threads, name=name)

    def run(self) -> None:
        args, scen = self.args, self.args.scenarios
        if self.dtype == args.dtypes[0] and scen & {"A", "C"}:
            self.run_llama_cpp()
        if scen & {"A", "B"}:  # the default configuration: prefix cache on
            with self.server(name="freetoken") as srv:
                url = srv.url + "/v1/completions"
                # As many requests as A sends: after 32, whichever of A's runs came first still
                # ran ~6 % below the other (masks on 98-107 against off 108-114 req/s, bfloat16).
                bc.run_load(url, score_payloads(items(self.tok, self.n, "warm"), self.labels), 16)
                if "A" in scen:
                    self.scenario_a(url)
                if "B" in scen:
                    warm = [self.prefix + s for s in items(self.tok, 4, "B-warm")]
                    bc.run_load(url, score_payloads(warm, self.labels), 4)  # caches the prefix
                    b_on = bc.run_load(url, score_payloads([self.prefix + s for s in self.b_items],
                                                           self.labels), args.clients)
                    t_kv = self.hf.score_with_prefix(self.prefix, self.b_items, self.labels,
                                                     args.hf_batch)
        if scen & {"B", "C"}:
            with self.server("--no-prefix-cache", name="freetoken-nocache") as srv:
                bc.run_load(srv.url + "/v1/completions",
                            score_payloads(items(self.tok, 16, "warm"), self.labels), 16)
                if "B" in scen:
                    self.scenario_b(srv.url + "/v1/completions", b_on, t_kv)
                if "C" in scen:
                    self.scenario_c(srv.url + "/v1/chat/completions")
        if "R" in scen:
            self.scenario_r()
        if "E" in scen:
            self.scenario_e()
        if "L" in scen:
            self.scenario_l()

    def pooling_model(self, role: str) -> tuple[Path | None, object, HFPeer]:
        """--pooling-model's (folder, tokenizer, HF peer) for `role`, "rerank" or "embed"; the
        folder None for the default model."""
        if self.args.pooling_model == "default":
            return None, self.tok, self.hf
        sys.path.insert(0, str(ROOT))
        from tests.fixtures import build_models as bm

        name, build = (("tiny-qwen3", bm.build_tiny_qwen3) if role == "rerank" else
                       ("tiny-qwen3-embedding", bm.build_tiny_qwen3_embedding))
        peer = HFPeer(self.dtype, bm.cached(name, build))
        return bm.cached(name, build), peer.tok, peer

    def alternated(self, url: str, payloads: list[dict], peer) -> tuple[bc.LoadResult, float, list]:
        """Ours one request, then the peer (seconds, result), in turn for every payload: ours
        best request and the peer's best time (the machine is shared and its load moves)."""
        best, t_peer, out = None, math.inf, None
        for payload in payloads:
            r = bc.run_load(url, [payload], 1)
            best = r if best is None or r.wall_s < best.wall_s else best
            t, out = peer()
            t_peer = min(t_peer, t)
        return best, t_peer, out

    def scenario_r(self) -> None:
        """64 documents under one query, a new query per request, cache on and off, and /score;
        each request alternated with HF scoring the same prompts."""
        n_docs, rounds = 64, 2 if self.args.quick else 3
        folder, tok, hf = self.pooling_model("rerank")
        docs = items(tok, n_docs, "R")
        queries = [f"Which reviews praise {TOPICS[i % len(TOPICS)]}? (query {i})"
                   for i in range(3 * rounds + 1)]
        template = RERANK_TEMPLATE.read_text()
        labels = tok.convert_tokens_to_ids(["no", "yes"])

        def hf_scores(query: str):
            prompts = [tok.apply_chat_template(
                [{"role": "query", "content": query}, {"role": "document", "content": d}],
                chat_template=template, tokenize=False) for d in docs]
            return lambda: hf.score(prompts, labels, n_docs)

        model = ("--model", str(folder)) if folder else ()
        rows, ours = [], {}
        for cache in (True, False):
            flags = (*model, "--runner", "pooling", "--hf-overrides", RERANK_OVERRIDES,
                     "--chat-template", str(RERANK_TEMPLATE), *(() if cache else ("--no-prefix-cache",)))
            with self.server(*flags, name=f"freetoken-rerank{'' if cache else '-nocache'}") as srv:
                bc.run_load(srv.url + "/v1/rerank", [{"query": queries[0], "documents": docs}], 1)
                qs = queries[1 + rounds * (not cache) : 1 + rounds * (1 + (not cache))]
                for path, body in (("/v1/rerank", "documents"), ("/score", "text_2")):
                    if path == "/score" and not cache:
                        continue
                    first = "query" if path == "/v1/rerank" else "text_1"
                    asked = qs if path == "/v1/rerank" else [q + " (/score)" for q in qs]
                    ours[path, cache] = self.alternated(
                        srv.url + path, [{first: q, body: docs} for q in asked], hf_scores(qs[-1]))
                if cache:
                    check = bc.run_load(srv.url + "/v1/rerank",
                                        [{"query": queries[1], "documents": docs}], 1).responses[0]
        for (path, cache), (r, t_hf, _) in ours.items():
            label = f"freetoken {path}, " + ("prefix cache on" if cache else "--no-prefix-cache")
            rows.append([label, n_docs / r.wall_s, bc.ms(r.wall_s), r.cached_tokens() / n_docs,
                         bc.ms(t_hf), bc.ratio(t_hf, r.wall_s)])
        bc.print_table(f"R: rerank, {n_docs} documents under one query, {self.dtype}, "
                       f"{'tiny-qwen3' if folder else 'default model'}, best of {rounds} "
                       f"alternated with HF (batch {n_docs})",
                       ["system", "documents/s", "ms per request", "cached tok/doc",
                        "HF ms", "vs HF"], rows)
        got = {x["index"]: x["relevance_score"] for x in check["results"]}
        _, hf_lps = hf_scores(queries[1])()
        diff = max(abs(got[i] - math.exp(hf_lps[i][1])) for i in range(n_docs))
        bc.note(f"check: scores vs HF p(yes) / (p(yes) + p(no)): max |diff| {diff:.2e}")
        bc.load_note()

    def scenario_e(self) -> None:
        """/v1/embeddings of 64 inputs, a new set per request, alternated with HF."""
        n, rounds = 64, 2 if self.args.quick else 3
        folder, tok, hf = self.pooling_model("embed")
        sets = [items(tok, n, f"E{i}") for i in range(rounds + 1)]
        model = ("--model", str(folder)) if folder else ()
        with self.server(*model, "--runner", "pooling", name="freetoken-embed") as srv:
            url = srv.url + "/v1/embeddings"
            bc.run_load(url, [{"input": sets[0]}], 1)
            r, t_hf, ref = self.alternated(url, [{"input": x} for x in sets[1:]],
                                           lambda: hf.embed(sets[-1]))
            check = bc.run_load(url, [{"input": sets[-1]}], 1).responses[0]["data"]
        rows = [["freetoken /v1/embeddings", n / r.wall_s, bc.ms(r.wall_s), bc.ms(t_hf),
                 bc.ratio(t_hf, r.wall_s)]]
        bc.print_table(f"E: embeddings, {n} inputs a request, {self.dtype}, "
                       f"{'tiny-qwen3-embedding' if folder else 'default model'}, best of "
                       f"{rounds} alternated with HF (batch {n})",
                       ["system", "inputs/s", "ms per request", "HF ms", "vs HF"], rows)
        diff = max(abs(a - b) for d, v in zip(check, ref) for a, b in zip(d["embedding"], v))
        bc.note(f"check: vectors vs HF's: max |diff| {diff:.2e}")
        bc.load_note()

    def scenario_l(self) -> None:
        """Whole labels: /generative_scoring (one request) vs one echo request per (prompt,
        label) on /v1/completions vs HF, alternated per round, on new prompts each time (a
        prompt seen before would come from the prefix cache)."""
        args, n = self.args, self.n
        labels = [self.tok.encode(w, add_special_tokens=False) for w in LABEL_SET]
        prompts = lambda tag: [self.tok.encode(p) for p in items(self.tok, n, tag)]  # noqa: E731

        def scoring(ps):
            return [{"query": [], "items": ps, "labels": labels}]

        def echo(ps):
            return [{"prompt": p + label, "max_tokens": 0, "echo": True, "logprobs": 0}
                    for p in ps for label in labels]

        best: dict[str, float] = {}
        with self.server(name="freetoken-labels") as srv:
            gs, comp = srv.url + "/generative_scoring", srv.url + "/v1/completions"
            bc.run_load(gs, scoring(prompts("L-warm")[:16]), 1)
            bc.run_load(comp, echo(prompts("L-warm-echo")[:8]), args.clients)
            for i in range(args.rounds):
                ours_prompts = prompts(f"L{i}")
                r = bc.run_load(gs, scoring(ours_prompts), 1)
                e = bc.run_load(comp, echo(prompts(f"L-echo{i}")), args.clients)
                t_hf, hf_totals = self.hf.label_totals(ours_prompts, labels, args.hf_batch)
                for key, t in (("ours", r.wall_s), ("echo", e.wall_s), ("hf", t_hf)):
                    best[key] = min(best.get(key, math.inf), t)
                if i == 0:
                    checked, checked_hf, usage = r.responses[0], hf_totals, r.responses[0]["usage"]
                    checked_prompts = ours_prompts
            echo_lps = [x["choices"][0]["logprobs"]["token_logprobs"]  # round 0's first two
                        for x in bc.run_load(comp, echo(checked_prompts[:2]), args.clients).responses]
        ours_totals = [[x["logprob"] for x in d["labels"]] for d in checked["data"]]
        rows = [[name, n / best[key], bc.ms(best[key]), bc.ratio(best["echo"], best[key]),
                 bc.ratio(best["hf"], best[key])]
                for name, key in (("freetoken /generative_scoring, one request", "ours"),
                                  (f"freetoken, echo request per label, {args.clients} clients", "echo"),
                                  (f"HF transformers, batch {args.hf_batch}", "hf"))]
        bc.print_table(f"L: {n} prompts x {len(labels)} labels of {'/'.join(str(len(x)) for x in labels)} "
                       f"tokens, {self.dtype}, best of {args.rounds} round(s) alternated",
                       ["system", "prompts/s", "ms", "/generative_scoring vs it", "vs HF"], rows)
        diff = max(abs(a - b) for o, h in zip(ours_totals, checked_hf) for a, b in zip(o, h))
        by_echo = [sum(lps[-len(labels[k % len(labels)]):]) for k, lps in enumerate(echo_lps)]
        diff_echo = max(abs(a - b) for a, b in zip(by_echo, [x for o in ours_totals[:2] for x in o]))
        bc.note(f"check: label totals vs HF max |diff| {diff:.2e}, vs echo {diff_echo:.2e}; "
                f"ours ran {usage['prompt_tokens']} tokens, {usage['prompt_tokens_details']['cached_tokens']} "
                f"from the prefix cache")
        bc.load_note()

    def run_llama_cpp(self) -> None:
        """llama.cpp's server on the same GGUF file (its own Q4_1 kernels), first pass only."""
        args = self.args
        server = bc.llama_cpp_server(bc.default_gguf(), threads=args.threads)
        if server is None:
            bc.note(bc.LLAMA_CPP_MISSING)
            return
        with server as srv:
            if "A" in args.scenarios:  # no allowed_token_ids there: top-2 logprobs, unmasked
                self.llama["A"] = bc.run_load(srv.url + "/v1/completions",
                                              score_payloads(self.a_items, None), args.clients)
            if "C" in args.scenarios:
                for c in args.levels:
                    self.llama[f"C {c}"] = bc.run_load(
                        srv.url + "/v1/chat/completions",
                        [{"messages": m, "max_tokens": args.new_tokens, "temperature": 0}
                         for m in chat_messages(self.c_counts[c], f"C{c}")], c)

    def scenario_a(self, url: str) -> None:
        args, st, n = self.args, self.st, self.n
        # Each round: ours with the masks, HF on the same items, ours without (on other items of
        # the same size: the same ones would now hit the prefix cache); a new set each round.
        on = off = None
        t_hf, tok_a = math.inf, 0
        for i in range(args.rounds):
            round_items = self.a_items if i == 0 else items(self.tok, n, f"A{i}")
            r_on = bc.run_load(url, score_payloads(round_items, self.labels), args.clients)
            t, lps = self.hf.score(round_items, self.labels, args.hf_batch)
            r_off = bc.run_load(url, score_payloads(items(self.tok, n, f"A-off{i}"), None), args.clients)
            if i == 0:
                checked, hf_lps = r_on, lps
            on = r_on if on is None or r_on.rps > on.rps else on
            off = r_off if off is None or r_off.rps > off.rps else off
            if t < t_hf:
                t_hf, tok_a = t, n_tokens(self.tok, round_items)
        hf_rps = n / t_hf
        llama = self.llama.get("A")
        rows = []
        for r, label in ((on, "freetoken, label masks on"), (off, "freetoken, label masks off")):
            tokens = r.usage_sum("prompt_tokens")
            rows.append([label, r.rps, bc.ms(r.p50), bc.ms(r.p99), tokens / r.wall_s,
                         st.pct_roofline(tokens, r.n, r.wall_s), bc.ratio(r.rps, hf_rps),
                         bc.ratio(r.rps, llama.rps) if llama else "-"])
        rows.append([f"HF transformers, batch {args.hf_batch}", hf_rps, "-", "-", tok_a / t_hf,
                     st.pct_roofline(tok_a, n, t_hf), "1.00x",
                     bc.ratio(hf_rps, llama.rps) if llama else "-"])
        if llama:
            rows.append(["llama.cpp server (Q4_1, no mask)", llama.rps, bc.ms(llama.p50),
                         bc.ms(llama.p99), llama.usage_sum("prompt_tokens") / llama.wall_s, "-",
                         bc.ratio(llama.rps, hf_rps), "1.00x"])
        bc.print_table(
            f"A: {n} scoring requests (~{tok_a / n:.0f} tokens), {args.clients} clients, "
            f"{self.dtype}, best of {args.rounds} round(s)", ["system", "req/s", "p50 ms", "p99 ms", "prompt tok/s",
                              "% roofline", "vs HF", "vs llama.cpp"], rows)
        ours = [label_logprobs(r, self.labels) for r in checked.responses]
        diff = max(abs(a - b) for o, h in zip(ours, hf_lps) for a, b in zip(o, h))
        agree = sum((o[0] > o[1]) == (h[0] > h[1]) for o, h in zip(ours, hf_lps))
        bc.note(f"check: label logprobs, server (masked, renormalised) vs HF: max |diff| "
                f"{diff:.2e}, same label {agree}/{n}")
        bc.note(f"load generator ({bc.http_client}, on this machine): {checked.client_cpu_ms:.2f} ms "
                f"CPU a request")
        self.a_rps = on.rps
        bc.load_note()

    def scenario_b(self, url: str, on: bc.LoadResult, t_kv: float) -> None:
        args, st, n, m = self.args, self.st, self.n, self.n_b_off
        full = [self.prefix + s for s in self.b_items]
        off = bc.run_load(url, score_payloads(full[:m], self.labels), args.clients)
        t_re = self.hf.score(full[:m], self.labels, args.hf_batch)[0]
        tok_full = n_tokens(self.tok, full) / n
        tok_item = n_tokens(self.tok, self.b_items) / n
        rows = []
        for r, label in ((on, "freetoken, prefix cache on"), (off, "freetoken, --no-prefix-cache")):
            computed = r.usage_sum("prompt_tokens") - r.cached_tokens()
            rows.append([label, r.n, r.rps, bc.ms(r.p50), bc.ms(r.p99), r.cached_tokens() / r.n,
                         computed / r.n, st.pct_roofline(computed, r.n, r.wall_s),
                         bc.ratio(r.rps, off.rps)])
        rows.append([f"HF, prefix KV reused, batch {args.hf_batch}", n, n / t_kv, "-", "-",
                     tok_full - tok_item, tok_item,
                     st.pct_roofline(round(tok_item * n), n, t_kv), bc.ratio(n / t_kv, off.rps)])
        rows.append([f"HF, prefix recomputed, batch {args.hf_batch}", m, m / t_re, "-", "-",
                     0.0, tok_full, st.pct_roofline(round(tok_full * m), m, t_re),
                     bc.ratio(m / t_re, off.rps)])
        bc.print_table(
            f"B: items behind a {tok_full - tok_item:.0f}-token shared prefix, {args.clients} "
            f"clients, {self.dtype}",
            ["system", "items", "items/s", "p50 ms", "p99 ms", "cached tok/item",
             "computed tok/item", "% roofline", "vs no cache"], rows)
        a = getattr(self, "a_rps", None)
        vs_a = (f"{bc.ratio(on.rps, a)} of scenario A's requests/s (same items without the "
                f"prefix), " if a else "")
        bc.note(f"cache on: {vs_a}{bc.ratio(on.rps, n / t_kv)} HF with the prefix KV reused; "
                f"cache off: {bc.ratio(off.rps, m / t_re)} HF recomputing the prefix")
        bc.load_note()

    def scenario_c(self, url: str) -> None:
        args = self.args
        bc.run_load(url, chat_payloads(chat_messages(4, "warm"), 8), 4)
        self.hf.generate(chat_messages(2, "warm"), 8)
        rows = []
        for c in args.levels:
            msgs = chat_messages(self.c_counts[c], f"C{c}")
            r = bc.run_load(url, chat_payloads(msgs, args.new_tokens), c)
            tps = r.usage_sum("completion_tokens") / r.wall_s
            # HF: batches of `c` prompts (two single prompts when c = 1).
            batches = [msgs[0:1], msgs[1:2]] if c == 1 else [msgs[:c]]
            hf_tps = (sum(len(b) for b in batches) * args.new_tokens
                      / sum(self.hf.generate(b, args.new_tokens) for b in batches))
            lr = self.llama.get(f"C {c}")
            l_tps = lr.usage_sum("completion_tokens") / lr.wall_s if lr else None
            rows.append([c, r.n, tps, bc.ms(r.p50), bc.ms(r.p99), hf_tps, bc.ratio(tps, hf_tps),
                         l_tps, bc.ratio(tps, l_tps)])
        bc.print_table(
            f"C: chat decode, {args.new_tokens} new tokens per request, {self.dtype} (tokens/s)",
            ["clients", "requests", "freetoken tok/s", "p50 ms", "p99 ms",
             "HF generate (batch = clients)", "vs HF", "llama.cpp tok/s", "vs llama.cpp"], rows)
        bc.load_note()


def main() -> None:
    p = bc.base_parser(__doc__.split("\n")[0], repeats=False)
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, or both comma-separated")
    p.add_argument("--scenarios", default="A,B,C", help="any of A, B, C, R, E, L, comma-separated")
    p.add_argument("--pooling-model", choices=("default", "tiny"), default="default",
                   help="R and E's model: the default one, or the tests' tiny Qwen3 fixtures")
    p.add_argument("--items", type=int, default=None,
                   help="scoring requests in A and B (default 256, quick 64)")
    p.add_argument("--items-no-cache", type=int, default=None,
                   help="B without cache and HF recomputing the prefix score only this many "
                        "(default 32, quick 16)")
    p.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients in A and B")
    p.add_argument("--rounds", type=int, default=None,
                   help="A's rounds (ours masked, HF, ours unmasked), each side's best kept; "
                        "default 2, 1 with --quick")
    p.add_argument("--prefix-tokens", type=int, default=400, help="shared prefix length in B")
    p.add_argument("--hf-batch", type=int, default=32, help="batch size of the HF scoring peer")
    p.add_argument("--concurrency", default="1,8,32", help="scenario C client counts")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per chat request in C")
    p.add_argument("--kv-cache-tokens", type=int, default=81920,
                   help="servers' KV pool: room for every A and B prompt, so nothing is evicted")
    args = p.parse_args()
    bc.setup(args)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.dtypes = bc.parse_dtypes(args.dtype)
    args.scenarios = {s.strip().upper() for s in args.scenarios.split(",")}
    args.levels = [int(c) for c in args.concurrency.split(",")]
    tokenizer = bc.load_tokenizer()
    label_ids = [tokenizer.encode(t, add_special_tokens=False)[0] for t in LABELS]
    for dtype in args.dtypes:
        print(f"\n## {dtype}")
        bc.kernel_heading(load_model(None, dtype=dtype, device="cpu"))
        Run(args, dtype, tokenizer, label_ids).run()
        gc.collect()


if __name__ == "__main__":
    main()
