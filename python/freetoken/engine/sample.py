"""Turns one step's logits into token ids (and optional logprobs) for a batch of requests.

Order of operations, per row (mirrors vLLM's v1 sampler, "raw_logprobs" mode):

1. Cast the logits to fp32.
2. Raw logprobs = log_softmax(logits), for rows that want logprobs and have no allowed_token_ids.
3. Masks: logits outside allowed_token_ids, and those the row's grammar forbids (structured
   outputs, once its grammar is active; structured/matcher.py), become -inf. Both come before
   the logit processors, as vLLM applies its grammar bitmask before its sampler. A stopped
   grammar allows only EOS; other rows are untouched.
4. Rows with allowed_token_ids that want logprobs: log_softmax of the *masked* logits, i.e.
   renormalised over what the row may sample (its allowed ids, and of those what its grammar
   allows). A grammar row without allowed_token_ids keeps the raw logprobs of step 2: the grammar
   shapes what it samples, not its logprobs (vLLM masks the logits before its sampler, so its
   logprobs are renormalised over what the grammar allows). Steps 2 and 4 are one batched
   log_softmax (x - logsumexp(x)) taken after the masks that logprobs see (the allowed ids, and
   the grammar on rows with allowed ids), which are the identity on the other rows.
5. Logit processors (engine/logit_processing.py); the logprobs of steps 2/4 never see them.
   In vLLM's order: bad_words (the last id of each word whose other ids end the output
   becomes -inf), min_tokens (while the output is shorter, stop_token_ids and, unless
   ignore_eos, the EOS ids become -inf), logit_bias (added), then the penalties: repetition
   (ids in the prompt or output: positive logits divided by it, others multiplied), then
   frequency (times the id's count in the output) and presence (ids in the output) subtracted.
6. Greedy rows (params.is_greedy: temperature < 1e-5, as vLLM, or top_k == 1): exact argmax of
   the processed logits.
7. Random rows: divide by temperature, then min_p (drop tokens with prob < min_p * max prob), then
   top-k, then top-p (smallest set whose cumulative prob >= top_p, renormalised over the top-k
   set; the top token is always kept; ties with the last kept logit are kept), then an
   exponential race, argmax(probs / Exp(1)), with the noise of row i drawn from generators[i]
   only, so seeded rows do not depend on their batch neighbours or row position.
8. Logprobs from the distribution of step 2/4: the sampled token's logprob, its rank
   (1 + number of tokens with a strictly greater logprob) and the top-K sorted descending,
   K = params.logprobs; a row with params.logprob_token_ids gets the logprobs of those ids, in
   their order, instead of the top-K (vLLM's `logprob_token_ids`). The logit processors,
   temperature, min_p, top-k and top-p never change logprobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from freetoken.core import SamplingParams, TokenLogprob
from freetoken.engine.logit_processing import History, LogitProcessing
from freetoken.kernels.plan import sampler_reductions
from freetoken.structured.matcher import GrammarMasks

if TYPE_CHECKING:
    from llguidance import LLMatcher

_NEG_INF = float("-inf")
# top-k/top-p look at this many largest logits first (a topk, not a vocabulary sort); a top-p row
# whose cut lies further out (flat distribution, no top_k) triggers a full-vocabulary retry.
TOP_P_CANDIDATES = 1024


@dataclass
class BatchSamplingArgs:
    """Per-row tensors built once by `Sampler.prepare`; a None field means nobody uses it.

    Random-stage tensors (temperature .. top_p) are aligned with `rand_rows`, not with the batch.
    """

    batch_size: int
    greedy_rows: torch.Tensor | None  # [G] long; None: no greedy row
    rand_rows: torch.Tensor | None  # [R] long; None: every row is greedy
    rand_generators: list[torch.Generator]  # aligned with rand_rows
    temperature: torch.Tensor | None  # [R, 1]; None when all random rows use 1.0
    log_min_p: torch.Tensor | None  # [R, 1]; -inf disables the row
    top_k: torch.Tensor | None  # [R, 1] long, V disables the row; also built when top_p is
    top_k_max: int  # largest enabled top_k, on the host so topk sizes need no device sync
    top_p: torch.Tensor | None  # [R, 1]; 2.0 disables the row
    mask: torch.Tensor | None  # [B, V] bool, True = banned; None: no row is masked
    sample_mask: torch.Tensor | None  # [B, V] bool: grammar bans that raw logprobs do not see
    processing: LogitProcessing | None  # None: no row uses a logit processor
    lp_rows: torch.Tensor | None  # [L] long rows that want logprobs; None: nobody does
    lp_k: list[int]  # K per row of lp_rows
    lp_allowed: list[tuple[int, ...] | None]  # per row of lp_rows: its sorted allowed ids
    lp_listed: list[list[int] | None]  # per row of lp_rows: the ids it lists instead of a top-K
    # The logits' columns where the LM head computed these ids alone (sorted; every other logit
    # is -inf), None for whole rows; `compact`: sampled on them (every row greedy, masked, no
    # processor or grammar), else widened to the vocabulary first. `mask` has the logits' width.
    columns: tuple[int, ...] | None = None
    compact: bool = False


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of float32 `x` [N, V] (long [N]), by torch's rules: the first of tied
    maxima, a NaN above every number."""
    return x.argmax(dim=-1)


def numpy_argmax(x: torch.Tensor) -> torch.Tensor:
    """`argmax` of a CPU `x` by numpy, which gives the same index with a vectorised scan: torch's
    argmax walks a row one element at a time (~60 us over 49k logits, ~20x numpy)."""
    return torch.from_numpy(x.numpy().argmax(-1))


# The sampler's argmax by the kernel plan's name for it (kernels/plan.py's `sampler_reductions`).
ARGMAX = {"numpy": numpy_argmax, "torch": argmax}


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp of each row of `x` [N, V] as [N, 1], with bits that do not depend on N: torch
    sums a lone row in slices across threads (a two-pass reduction) but each of several rows on
    one thread, so a lone row is reduced as one of two."""
    if x.shape[0] == 1:
        return x.expand(2, -1).logsumexp(-1, keepdim=True)[:1]
    return x.logsumexp(-1, keepdim=True)


class SampleOutput(NamedTuple):
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # None for rows with params.logprobs is None


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str = "cpu",
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = eos_token_ids  # banned with stop_token_ids before min_tokens
        self.grammar_masks = GrammarMasks(vocab_size, self.device)
        self.argmax = ARGMAX[sampler_reductions(self.device)["argmax"]]

    def _rows(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _col(self, values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device).unsqueeze(1)

    def prepare(
        self, params: list[SamplingParams], generators: list[torch.Generator],
        histories: list[History] | None = None, grammars: list[LLMatcher | None] | None = None,
        columns: list[int] | None = None,
    ) -> BatchSamplingArgs:
        """`histories`: per row, its (prompt ids, output ids so far), which penalties, min_tokens
        and bad_words read; None when no row uses them. `grammars`: per row, the matcher that
        constrains it or None; None when no row is constrained. `columns`: the logits hold these
        ids' columns alone (BatchSamplingArgs.columns)."""
        assert len(params) == len(generators), "one generator per row"
        V, B = self.vocab_size, len(params)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        rand = [i for i, p in enumerate(params) if not p.is_greedy]
        rp = [params[i] for i in rand]

        # Each random-stage tensor exists only if at least one random row changes something.
        temperature: torch.Tensor | None = None
        log_min_p: torch.Tensor | None = None
        top_k: torch.Tensor | None = None
        top_p: torch.Tensor | None = None
        ks = [p.top_k if 0 < p.top_k < V else V for p in rp]
        if any(p.temperature != 1.0 for p in rp):
            temperature = self._col([p.temperature for p in rp], torch.float32)
        if any(p.min_p > 0.0 for p in rp):
            log_min_p = self._col([math.log(p.min_p) if p.min_p > 0 else _NEG_INF for p in rp],
                                  torch.float32)
        use_top_p = any(p.top_p < 1.0 for p in rp)
        if use_top_p or any(k < V for k in ks):
            top_k = self._col(ks, torch.long)
        if use_top_p:
            # top_p >= 1 becomes 2: cumsum rounding near 1.0 can then never cut such a row's tail.
            top_p = self._col([p.top_p if p.top_p < 1.0 else 2.0 for p in rp], torch.float32)

        processing = LogitProcessing.build(params, histories, self.eos_token_ids, V, self.device)
        # Sampling on the head's columns alone gives every row the bits of its whole row: an
        # argmax over its allowed ids, first of ties (the columns are sorted), and its logprobs
        # over its allowed columns (_logprobs). Random draws and processors are vocabulary-wide.
        compact = (columns is not None and not rand and processing is None and grammars is None
                   and all(p.allowed_token_ids for p in params))
        at = {t: i for i, t in enumerate(columns)} if compact else None
        mask = sample_mask = None
        masked = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        if masked:
            # One index_put for all masked rows: start banned, then free the allowed ids.
            mask = torch.zeros(B, len(columns) if compact else V, dtype=torch.bool, device=self.device)
            mask[masked] = True
            ids = [params[i].allowed_token_ids or [] for i in masked]
            r = [i for i, row_ids in zip(masked, ids) for _ in row_ids]
            flat = [t for row_ids in ids for t in row_ids]
            mask[self._rows(r), self._rows([at[t] for t in flat] if at else flat)] = False
        if grammars is not None and any(m is not None for m in grammars):
            banned = self.grammar_masks.banned(grammars)
            if any(m is not None and p.logprobs is not None and p.allowed_token_ids is None
                   for p, m in zip(params, grammars)):
                # Raw logprobs never see the grammar: its bans go to a mask that sampling alone
                # applies, and to `mask` on the rows whose logprobs see their allowed ids.
                sample_mask = banned
                if mask is not None:
                    mask[masked] |= banned[masked]
            else:
                mask = banned if mask is None else mask | banned

        lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        return BatchSamplingArgs(
            batch_size=B,
            greedy_rows=self._rows(greedy) if greedy else None,
            rand_rows=self._rows(rand) if rand else None,
            rand_generators=[generators[i] for i in rand],
            temperature=temperature,
            log_min_p=log_min_p,
            top_k=top_k,
            top_k_max=max([k for k in ks if k < V], default=1),
            top_p=top_p,
            mask=mask,
            sample_mask=sample_mask,
            processing=processing,
            lp_rows=self._rows(lp) if lp else None,
            lp_k=[min(k, V) if k >= 0 else V for k in (int(params[i].logprobs or 0) for i in lp)],
            lp_allowed=[_sorted_ids(params[i].allowed_token_ids) for i in lp],
            lp_listed=[params[i].logprob_token_ids for i in lp],
            columns=tuple(columns) if columns is not None else None,
            compact=compact,
        )

    def sample(self, logits: torch.Tensor, args: BatchSamplingArgs) -> SampleOutput:
        """`logits` [B, V], or [B, len(args.columns)]: those ids' logits alone."""
        width = self.vocab_size if args.columns is None else len(args.columns)
        assert logits.shape == (args.batch_size, width), logits.shape
        x = logits.float()
        if args.columns is not None and not args.compact:
            x = widen(x, self.vocab_size, args.columns)
        if args.mask is not None:
            x = x.masked_fill(args.mask, _NEG_INF)  # out of place: never edit the caller's logits
        raw = x  # the logprobs' distribution: before the processors
        if args.sample_mask is not None:
            x = x.masked_fill(args.sample_mask, _NEG_INF)
        if args.processing is not None:
            if x is logits or (x is raw and args.lp_rows is not None):  # keep the caller's or `raw`
                x = x.clone()
            args.processing.apply(x)

        if args.compact:
            tokens = self._compact_argmax(x, args.columns)
        elif args.rand_rows is None:  # all greedy: argmax only, no softmax
            tokens = self.argmax(x)
        elif args.greedy_rows is None:  # all random
            tokens = self._sample_random(x, args)
        else:
            tokens = torch.empty(args.batch_size, dtype=torch.long, device=x.device)
            tokens[args.greedy_rows] = self.argmax(x[args.greedy_rows])
            tokens[args.rand_rows] = self._sample_random(x[args.rand_rows], args)

        token_ids: list[int] = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * args.batch_size
        if args.lp_rows is not None:
            for row, lp in zip(args.lp_rows.tolist(), self._logprobs(raw, tokens, args)):
                logprobs[row] = lp
        return SampleOutput(token_ids, logprobs)

    def _compact_argmax(self, x: torch.Tensor, columns: tuple[int, ...]) -> torch.Tensor:
        """Each row's argmax as a vocabulary id, `x` [B, C] holding `columns`' logits: the whole
        row's argmax, whose other logits are -inf; 0 (the first of a row all -inf) where the
        row's every allowed logit is -inf."""
        at = self.argmax(x)
        dead = x.gather(1, at.unsqueeze(1)).squeeze(1) == _NEG_INF
        return torch.tensor(columns, device=x.device)[at].masked_fill_(dead, 0)

    def skip_draws(self, generator: torch.Generator, rows: int) -> None:
        """Advance `generator` as sampling `rows` random rows does."""
        for _ in range(rows):
            torch.empty(self.vocab_size, device=self.device).uniform_(generator=generator)  # fp32, as q

    def _sample_random(self, x: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        """Sample the random rows; `x` holds exactly those rows and is not modified."""
        x = x / args.temperature if args.temperature is not None else x.clone()
        if args.log_min_p is not None:
            # prob_i < min_p * prob_max  <=>  x_i < x_max + log(min_p): no softmax needed.
            x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + args.log_min_p, _NEG_INF)
        if args.top_k is not None:
            self._top_k_top_p(x, args)
        probs = x.softmax(dim=-1)
        # Exponential race: argmax(p / E), E ~ Exp(1), is one multinomial draw without a device
        # sync. Each row draws its V uniforms from its own generator, so a seeded row's stream does
        # not depend on the rest of the batch. E = -log(u) (cheaper than exponential_); the clamp
        # keeps E > 0 even if u == 1, since p/0 or 0/0 would corrupt the argmax.
        q = torch.empty_like(probs)
        for j, g in enumerate(args.rand_generators):
            q[j].uniform_(generator=g)
        return self.argmax(probs.div_(q.log_().neg_().clamp_min_(torch.finfo(q.dtype).tiny)))

    def _top_k_top_p(self, x: torch.Tensor, args: BatchSamplingArgs) -> None:
        """Cut x in place to each row's top-k set, then its top-p set, without a vocabulary sort.

        Both cuts work on the c largest logits (topk, sorted). A row keeps every logit >= its last
        kept candidate, so ties with the cut survive.
        """
        assert args.top_k is not None
        V = x.shape[1]
        c = min(V, args.top_k_max if args.top_p is None else max(args.top_k_max, TOP_P_CANDIDATES))
        while True:
            v = x.topk(c, dim=-1).values
            n = args.top_k.clamp(max=c)  # kept prefix length
            uncut = args.top_k > c  # the row's top-k set may reach past the candidates
            if args.top_p is None:
                break
            pos = torch.arange(c, device=x.device)
            # Normaliser of the top-k set: its candidates when they hold it all, else the row.
            lse = torch.where(uncut, _logsumexp(x), _logsumexp(v.masked_fill(pos >= n, _NEG_INF)))
            p = (v - lse).exp()
            # Keep a token while the mass strictly before it is below top_p; the top one always.
            kept = ((p.cumsum(dim=-1) - p) < args.top_p) & (pos < n)
            kept[:, 0] = True
            n = kept.sum(dim=-1, keepdim=True)
            uncut &= n == c
            if c == V or not bool((uncut & (args.top_p <= 1.0)).any()):
                break
            c = V  # some top-p cut lies beyond the candidates: retry on the whole vocabulary
        thr = v.gather(1, n - 1).masked_fill_(uncut, _NEG_INF)
        x.masked_fill_(x < thr, _NEG_INF)

    def _logprobs(
        self, x: torch.Tensor, tokens: torch.Tensor, args: BatchSamplingArgs
    ) -> list[TokenLogprob]:
        """The entries of the rows that want logprobs. A row with allowed ids is computed on its
        allowed columns alone, renormalised over them (a listed id outside them at -inf): the
        rest of its row is -inf, which full-vocabulary passes would walk (exp(-inf) is MKL's slow
        path: ~4 ms a step for 8 scoring rows of a 49k vocabulary; a reranker's 64 rows of a
        248k one, ~0.4 s). Rows that allow the same ids go together, so a row's bits depend on
        its own ids, never on what else is in the batch."""
        assert args.lp_rows is not None
        out: list[TokenLogprob | None] = [None] * len(args.lp_k)
        by_ids: dict[tuple[int, ...], list[int]] = {}
        full: list[int] = []
        for j, ids in enumerate(args.lp_allowed):
            if ids is not None:
                by_ids.setdefault(ids, []).append(j)
            else:
                full.append(j)
        groups = [*by_ids.items(), *([(None, full)] if full else [])]
        # Where x holds the head's columns alone, an id's column is its place among them.
        held = torch.tensor(args.columns, device=x.device) if args.compact else None
        for ids, js in groups:
            rows = args.lp_rows if len(js) == len(args.lp_k) else args.lp_rows[js]
            ks = [args.lp_k[j] for j in js]
            if ids is not None:
                cols = torch.tensor(ids, device=x.device)
                at = torch.searchsorted(cols, tokens[rows]).clamp_(max=len(ids) - 1)
                # A token outside the ids (every allowed logit -inf) goes the full way.
                if bool((cols[at] == tokens[rows]).all()):
                    where = cols if held is None else torch.searchsorted(held, cols)
                    entries = logprob_entries(x[rows.unsqueeze(1), where], at, ks,
                                              [args.lp_listed[j] for j in js], columns=ids)
                else:
                    ids = None
            if ids is None:
                whole = x[rows] if held is None else widen(x[rows], self.vocab_size, args.columns)
                entries = logprob_entries(whole, tokens[rows], ks, [args.lp_listed[j] for j in js])
            for j, entry in zip(js, entries):
                out[j] = entry
        return out


def widen(values: torch.Tensor, vocab_size: int, columns: tuple[int, ...]) -> torch.Tensor:
    """Logits of `columns` alone ([N, len(columns)]) as whole rows [N, vocab_size], -inf at
    every other id (what the rows' masks would make of them)."""
    out = values.new_full((values.shape[0], vocab_size), _NEG_INF)
    out[:, list(columns)] = values
    return out


def _sorted_ids(ids: list[int] | None) -> tuple[int, ...] | None:
    return None if ids is None else tuple(sorted(set(ids)))


def logprob_entries(x: torch.Tensor, tokens: torch.Tensor, ks: list[int],
                    listed: list[list[int] | None] | None = None,
                    columns: tuple[int, ...] | None = None) -> list[TokenLogprob]:
    """One batched log-softmax / gather / topk: for row i of logits `x` [N, V], the logprob and
    rank of tokens[i] and the top ks[i]. A row with `listed` ids gets their logprobs, in order
    and all of them (a banned one at -inf), in place of its top-K. With `columns`, `x` [N, C]
    holds those vocabulary ids' logits alone (sorted; every other id is banned, -inf) and
    `tokens` index them: each row is renormalised over them, its -inf alternatives (ids its
    grammar bans too) are left out of its top-K, a listed id outside them is -inf, and the
    entries name vocabulary ids."""
    # x - logsumexp, not log_softmax: on AVX2 CPUs torch's fused fp32 log_softmax sums the
    # vocabulary in vector lanes and is off by ~3e-4 over 248k ids; logsumexp is within 2e-7.
    lp = x - _logsumexp(x)
    tok_lp = lp.gather(1, tokens.unsqueeze(1))
    ranks = ((lp > tok_lp).sum(dim=-1) + 1).tolist()
    tok_ids, tok_lps = tokens.tolist(), tok_lp.squeeze(1).tolist()
    listed = listed or [None] * len(ks)
    k_max = min(max((k for k, ids in zip(ks, listed) if ids is None), default=0), lp.shape[1])
    top_v: list[list[float]] = [[] for _ in ks]
    top_i: list[list[int]] = [[] for _ in ks]
    if k_max > 0:
        v, i = lp.topk(k_max, dim=-1)
        top_v, top_i = v.tolist(), i.tolist()
    listed_values = _listed_logprobs(lp, listed, columns)

    out = []
    for j, k in enumerate(ks):
        if listed[j] is not None:
            token = tok_ids[j] if columns is None else columns[tok_ids[j]]
            out.append(TokenLogprob(token, tok_lps[j], ranks[j], list(listed[j]), listed_values[j]))
            continue
        vals, ids = top_v[j][:k], top_i[j][:k]
        if columns is not None:
            n = sum(1 for val in vals if val != _NEG_INF)
            vals, ids = vals[:n], [columns[i] for i in ids[:n]]
            out.append(TokenLogprob(columns[tok_ids[j]], tok_lps[j], ranks[j], ids, vals))
            continue
        out.append(TokenLogprob(tok_ids[j], tok_lps[j], ranks[j], ids, vals))
    return out


def _listed_logprobs(lp: torch.Tensor, listed: list[list[int] | None],
                     columns: tuple[int, ...] | None = None) -> list[list[float]]:
    """Row j's logprobs at the ids listed[j] (empty where None), with one gather; with
    `columns`, `lp` holds those ids' columns alone and an id outside them is -inf."""
    rows = [j for j, ids in enumerate(listed) for _ in ids or ()]
    if not rows:
        return [[] for _ in listed]
    ids = [t for row_ids in listed for t in row_ids or ()]
    if columns is not None:  # an id outside the columns reads an appended -inf column
        at = {t: i for i, t in enumerate(columns)}
        ids = [at.get(t, len(columns)) for t in ids]
        lp = torch.cat([lp, lp.new_full((lp.shape[0], 1), _NEG_INF)], dim=1)
    flat = lp[torch.tensor(rows, device=lp.device), torch.tensor(ids, device=lp.device)].tolist()
    out, start = [], 0
    for row_ids in listed:
        out.append(flat[start : start + len(row_ids or ())])
        start += len(row_ids or ())
    return out
