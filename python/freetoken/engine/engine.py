"""One forward step: build the batch's tensors, run the model, sample, score prompt tokens."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from freetoken.core import Batch, Req, SamplingParams, TokenLogprob
from freetoken.engine import pooling
from freetoken.kvcache.kv_pool import KVPool, token_row
from freetoken.engine.logit_processing import long_tensor, uses_processors
from freetoken.engine.mtp import MtpDrafter
from freetoken.engine.sample import Sampler, logprob_entries
from freetoken.kvcache.state_pool import LinearContext, PrefillPiece, StatePool
from freetoken.kvcache.forward_context import DecodeGroup, ForwardContext, PromptGroup

# Requests whose padded lengths agree attend in one call (PromptGroup, DecodeGroup). Blocks trade
# padded work against the number of calls; these measured best on scoring prompts of ~40 tokens
# (A in docs/performance.md) and on decode batches of 8-32.
PROMPT_QUERY_BLOCK = 4  # also the 4 queries below which SDPA rounds a row differently
PROMPT_KV_BLOCK = 16
DECODE_KV_BLOCK = 64


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


class StepPlan(NamedTuple):
    """A step's rows as plain lists, padded: what `Engine.context` turns into tensors, and what
    tensor-parallel rank 0 sends the other ranks (engine/parallel.py)."""

    ids: list[int]
    positions: list[int]
    out_slots: list[int]
    logit_rows: list[int]
    chunks: list[tuple[int, int, list[int]]]  # prompt chunks: (first row, new tokens, key slots)
    decoding: list[tuple[int, list[int]]]  # decoding requests: (row, key slots)
    hidden_rows: list[int] = []  # rows whose final-norm hidden states pooling requests read
    logit_columns: list[int] | None = None  # ForwardContext.logit_columns


class StepOutput(NamedTuple):
    # Per batch.logit_reqs: the tokens it emits (one, or with drafts the accepted ones and the
    # token sampled after them) and their logprob entries (None where it asked for none).
    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob | None]]
    prompt_logprobs: list[TokenLogprob]  # one per row of batch.prompt_rows, in order


def prompt_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Entries of prompt tokens `targets`, each scored by its row of `logits`, with its top
    ks[i] alternatives. As vLLM's prompt logprobs, the raw distribution: the request's allowed
    ids, penalties and temperature only shape what it samples. The sampler's numerics, so a
    prompt entry matches a sampled one."""
    if not targets:
        return []
    return logprob_entries(logits.float(), torch.tensor(targets, device=logits.device), ks)


class Engine:
    def __init__(self, model: torch.nn.Module, num_kv_slots: int, device: torch.device,
                 dtype: torch.dtype, eos_token_ids: tuple[int, ...] = (), num_state_slots: int = 0,
                 mtp: bool = False):
        """`mtp`: the model's MTP head drafts (engine/mtp.py), its K/V in layers of its own."""
        self.model = model
        self.device = device
        cfg = getattr(model, "cfg", model)
        # Hybrid models keep K/V for their full-attention layers only, and a recurrent state per
        # request for the others (kvcache/state_pool.py).
        layers = getattr(cfg, "num_kv_layers", cfg.num_layers) + (cfg.mtp_layers if mtp else 0)
        self.kv = KVPool(num_kv_slots, layers, token_row(cfg), dtype, device)
        self.drafter = MtpDrafter(self) if mtp else None
        shape = getattr(model, "state_shape", None)
        self.states = StatePool(num_state_slots, shape, dtype, device) if shape else None
        self.sampler = Sampler(model.vocab_size, device, eos_token_ids)
        # Sliding-window layers get masks of their own in every attention group.
        self.window = getattr(cfg, "sliding_window", None) if getattr(cfg, "sliding_layers", None) else None
        self.can_pool = getattr(model, "supports_pooling", False)

    def new_generator(self, params: SamplingParams) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        if params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(params.seed)
        return gen

    @torch.inference_mode()
    def forward_batch(self, batch: Batch) -> StepOutput:
        """Run `batch`; the caller has already given every new token a KV slot."""
        logits, ctx = self.run_model(batch)
        # The head may have computed the allowed ids' columns alone (ForwardContext.logit_columns).
        columns = ctx.logit_columns if logits.shape[1] != self.sampler.vocab_size else None
        sampling = _sampling(batch.logit_reqs)
        tokens, logprobs = self._sample(logits, sampling, columns) if sampling else ([], [])
        if len(sampling) < len(batch.logit_reqs):
            tokens, logprobs = _with_pooled(batch.logit_reqs, tokens, logprobs)
        if ctx.mtp is not None:
            self.drafter.keep(batch, tokens, ctx.mtp)
        out = StepOutput(tokens, logprobs, self._score_prompts(batch, logits) if batch.prompt_rows else [])
        if ctx.hidden_rows is not None:
            self._collect_hidden(batch, ctx)
        if ctx.linear is not None:  # the step went through: its new recurrent states stand
            kept = {id(r): len(t) for r, t in zip(batch.logit_reqs, tokens)}
            self.states.commit(ctx.linear, torch.tensor([kept.get(id(r), 1) for r in ctx.linear.decoding],
                                                        device=self.device))
        return out

    def _score_prompts(self, batch: Batch, logits: torch.Tensor) -> list[TokenLogprob]:
        """The entries of batch.prompt_rows' rows, which follow the sampling rows in `logits`."""
        # Row i of a chunk starting at position s scores prompt token s + i + 1.
        start = {id(r): r.num_computed - len(new) for r, new in zip(batch.reqs, batch.new_ids)}
        targets, ks = [], []
        for req, rows in batch.prompt_rows:
            first = start[id(req)] + 1
            targets += req.prompt_ids[first : first + rows]
            ks += [req.params.prompt_logprobs] * rows
        n = sum(1 + len(r.drafts) for r in _sampling(batch.logit_reqs))
        return prompt_logprobs(logits[n : n + len(targets)], targets, ks)

    def _collect_hidden(self, batch: Batch, ctx: ForwardContext) -> None:
        """Hand each pooling request the hidden states of this step's positions it reads."""
        row = 0
        for req, new in zip(batch.reqs, batch.new_ids):
            if req.params.pooling is not None:
                at = pooling.positions(req, req.num_computed - len(new), len(new))
                if at:
                    pooling.collect(req, ctx.hidden[row : row + len(at)], at)
                    row += len(at)

    def _sample(self, logits: torch.Tensor, reqs: list[Req],
                columns: list[int] | None = None) -> tuple[list[list[int]], list[list]]:
        """Each request's tokens: a row each, in order; a request with drafts keeps the rows up
        to the first whose token is not its draft's (scheduler/speculation.py). Row j of a draft
        sees the output as if the j drafts before it were emitted (penalties, min_tokens,
        bad_words), and its random draw comes after theirs from the request's stream."""
        rows = [(r, j) for r in reqs for j in range(1 + len(r.drafts))]
        params = [r.params for r, _ in rows]
        grammars = [r.grammar.constraining if r.grammar else None for r, _ in rows]
        # A rejected draft's row drew from the stream all the same: rewound below.
        streams = {id(r): r.generator.get_state() for r in reqs
                   if r.drafts and not r.params.is_greedy}
        # Histories copy each output so far: only for the logit processors, which read them.
        histories = [(r.prompt_ids, r.output_ids + r.drafts[:j]) for r, j in rows] \
            if uses_processors(params) else None
        args = self.sampler.prepare(params, [r.generator for r, _ in rows], histories,
                                    grammars if any(g is not None for g in grammars) else None,
                                    columns)
        sampled = self.sampler.sample(logits[: len(rows)], args)
        if len(rows) == len(reqs):  # no drafts: a token each
            return [[t] for t in sampled.token_ids], [[lp] for lp in sampled.logprobs]
        tokens, logprobs, row = [], [], 0
        for req in reqs:
            drawn = sampled.token_ids[row : row + 1 + len(req.drafts)]
            kept = next((j for j, (t, d) in enumerate(zip(drawn, req.drafts)) if t != d),
                        len(req.drafts)) + 1
            tokens.append(drawn[:kept])
            logprobs.append(sampled.logprobs[row : row + kept])
            row += len(drawn)
            if id(req) in streams and kept < len(drawn):
                req.generator.set_state(streams[id(req)])
                self.sampler.skip_draws(req.generator, kept)
        return tokens, logprobs

    def run_model(self, batch: Batch) -> tuple[torch.Tensor, ForwardContext]:
        """The model's logit rows for `batch` (see Batch), and the context they were run in."""
        ctx = self.build_context(batch)
        return self.model(batch, ctx), ctx

    def idle(self) -> None:
        """Called by the scheduler on a step with nothing to run (engine/parallel.py)."""

    def _prompt_groups(self, chunks: list[tuple[int, int, list[int]]]) -> list[PromptGroup]:
        """Groups for prompt chunks given as (first row, new tokens q, slots of all keys)."""
        by_shape: dict[tuple[int, int, bool], list[tuple[int, int, list[int]]]] = {}
        for start, q, slots in chunks:
            kv_len = _round_up(len(slots), PROMPT_KV_BLOCK)
            # A whole prompt padded to as many queries as keys is plain causal: no mask, and the
            # kernel skips the blocks above the diagonal.
            causal = q == len(slots)
            by_shape.setdefault((kv_len if causal else _round_up(q, PROMPT_QUERY_BLOCK), kv_len, causal),
                                []).append((start, q, slots))
        groups = []
        on_device = partial(long_tensor, device=self.device)
        for (q_len, kv_len, causal), members in by_shape.items():
            query_rows, table, kept, out_rows = [], [], [], []
            for i, (start, q, slots) in enumerate(members):
                rows = list(range(start, start + q))
                query_rows += rows + [rows[-1]] * (q_len - q)
                table += self._padded(slots, kv_len)
                kept += range(i * q_len, i * q_len + q)
                out_rows += rows
            mask = window_mask = None
            if not causal or self.window:
                # Query j sits at position len(slots) - q + j and sees the keys up to it (and,
                # in a sliding layer, none `window` or more before it); padded queries repeat
                # the last one. Keys are addressed by position, so a prefix-cache hit or an
                # earlier chunk gives the same mask as a one-shot prefill.
                positions = torch.tensor([[len(slots) - q + min(j, q - 1) for j in range(q_len)]
                                          for _, q, slots in members])[:, :, None]
                keys = torch.arange(kv_len)[None, None, :]
                seen = keys <= positions
                if not causal:
                    mask = seen[:, None].to(self.device)
                if self.window:
                    window_mask = (seen & (keys > positions - self.window))[:, None].to(self.device)
            ranges = long_tensor([v for i, (_, q, slots) in enumerate(members) for j in range(q)
                                  for v in (i * kv_len, 0, len(slots) - q + j + 1)]).view(-1, 3)
            window_ranges = None
            if self.window:
                window_ranges = ranges.clone()
                window_ranges[:, 1] = (ranges[:, 2] - self.window).clamp(min=0)
            groups.append(PromptGroup(shape=(len(members), q_len, kv_len),
                                      query_rows=on_device(query_rows), kv_slots=on_device(table),
                                      mask=mask, kept=on_device(kept), out_rows=on_device(out_rows),
                                      window_mask=window_mask, key_ranges=ranges,
                                      window_key_ranges=window_ranges))
        return groups

    def _padded(self, slots: list[int], length: int) -> list[int]:
        """`slots` padded to `length` with the scratch slot, whose keys the masks hide."""
        return slots + [self.kv.scratch_slot] * (length - len(slots))

    def _decode_groups(self, decoding: list[tuple[int, list[int]]]) -> list[DecodeGroup]:
        """Groups for decoding requests given as (row, slots of all keys)."""
        by_length: dict[int, list[tuple[int, list[int]]]] = {}
        for row, slots in decoding:
            by_length.setdefault(_round_up(len(slots), DECODE_KV_BLOCK), []).append((row, slots))
        groups = []
        for length, members in by_length.items():
            table = [self._padded(slots, length) for _, slots in members]
            lengths = [len(slots) for _, slots in members]
            ranges = long_tensor([v for i, n in enumerate(lengths) for v in (i * length, 0, n)]).view(-1, 3)
            keys = torch.arange(length)[None, :]
            valid = keys < ranges[:, 2:]
            window = window_ranges = None
            if self.window:
                window = (valid & (keys >= ranges[:, 2:] - self.window))[:, None, None, :].to(self.device)
                window_ranges = long_tensor([v for i, n in enumerate(lengths)
                                             for v in (i * length, max(n - self.window, 0), n)]).view(-1, 3)
            groups.append(DecodeGroup(
                rows=long_tensor([row for row, _ in members], device=self.device),
                kv_slots=long_tensor(*table, device=self.device),
                valid=valid[:, None, None, :].to(self.device), window_valid=window,
                key_ranges=ranges, window_key_ranges=window_ranges))
        return groups

    def build_context(self, batch: Batch) -> ForwardContext:
        ctx = self.context(self.plan(batch))
        if self.states:
            ctx.linear = self._linear_context(batch)
        if self.drafter is not None:
            ctx.mtp = self.drafter.pass_for(batch, ctx)
        return ctx

    def plan(self, batch: Batch) -> StepPlan:
        ids, positions, out_slots, logit_rows, chunks, decoding = [], [], [], [], [], []
        hidden_rows = []
        logit_set = {id(r) for r in _sampling(batch.logit_reqs)}
        first_row = {}
        for req, new in zip(batch.reqs, batch.new_ids):
            total, q = req.num_computed, len(new)  # slots for `new` were appended before the step
            if req.drafts:  # each row a decode step at its own position
                decoding += [(len(ids) + j, req.slots[: total - q + j + 1]) for j in range(q)]
            elif _decodes(req, q):
                decoding.append((len(ids), req.slots))
            else:
                chunks.append((len(ids), q, req.slots))
            first_row[id(req)] = len(ids)
            ids += new
            positions += range(total - q, total)
            out_slots += req.slots[total - q :]
            if id(req) in logit_set:
                logit_rows += range(len(ids) - 1 - len(req.drafts), len(ids))
            if req.params.pooling is not None:
                start = total - q
                hidden_rows += [first_row[id(req)] + p - start
                                for p in pooling.positions(req, start, q)]
        for req, n in batch.prompt_rows:
            logit_rows += range(first_row[id(req)], first_row[id(req)] + n)
        return StepPlan(ids, positions, out_slots, logit_rows, chunks, decoding, hidden_rows,
                        _allowed_columns(batch))

    def context(self, plan: StepPlan) -> ForwardContext:
        dev = self.device
        return ForwardContext(
            input_ids=long_tensor(plan.ids, device=dev),
            positions=long_tensor(plan.positions, device=dev),
            out_slots=long_tensor(plan.out_slots, device=dev),
            prompt_groups=self._prompt_groups(plan.chunks),
            decode_groups=self._decode_groups(plan.decoding),
            logit_rows=long_tensor(plan.logit_rows, device=dev),
            kv_cache=self.kv.kv,
            hidden_rows=long_tensor(plan.hidden_rows, device=dev) if plan.hidden_rows else None,
            logit_columns=plan.logit_columns,
        )

    def _linear_context(self, batch: Batch) -> LinearContext:
        """Linear-attention layers: prompt pieces run one request at a time (chunked form),
        decoding requests together (recurrent form), a drafted request's rows one per round."""
        prefills, rows, slots, decoding = [], [], [], []
        row = 0  # the request's first row, as plan() lays them out
        for req, new in zip(batch.reqs, batch.new_ids):
            if req.drafts or _decodes(req, len(new)):
                rows.append(row)
                slots.append(req.state_slot)
                decoding.append(req)
            else:
                prefills.append(PrefillPiece(row, len(new), req.num_computed - len(new), req.state_slot,
                                             req.snapshots))
            row += len(new)
        on_device = partial(long_tensor, device=self.device)
        rounds = []
        for j in range(1, 1 + max((len(r.drafts) for r in decoding), default=0)):
            members = [i for i, r in enumerate(decoding) if len(r.drafts) >= j]
            rounds.append((on_device(members), on_device([rows[i] + j for i in members])))
        return LinearContext(self.states, prefills, on_device(rows) if rows else None,
                             on_device(slots) if slots else None, rounds, decoding)


# Allowed ids past which a step's logits are computed whole (the subset's weights are gathered
# and packed for each new set of ids).
MAX_LOGIT_COLUMNS = 256


def _allowed_columns(batch: Batch) -> list[int] | None:
    """The ids the LM head need compute (sorted), where every logit row is a request's that
    allows only some (scoring's labels: the rest of each row is -inf once masked); None where
    any row needs the whole vocabulary (prompt logprobs, an unmasked request)."""
    sampling = _sampling(batch.logit_reqs)
    if batch.prompt_rows or not sampling:
        return None
    ids: set[int] = set()
    for req in sampling:
        allowed = req.params.allowed_token_ids
        if not allowed:
            return None
        ids.update(allowed)
    return sorted(ids) if len(ids) <= MAX_LOGIT_COLUMNS else None


def _sampling(reqs: list[Req]) -> list[Req]:
    """The requests whose sampled token is read: a pooling request's one token never is, so it
    gets no logit row (no LM head, no sampler) and `_with_pooled` gives it a placeholder."""
    return [r for r in reqs if r.params.pooling is None]


def _with_pooled(reqs: list[Req], tokens: list[list[int]],
                 logprobs: list[list]) -> tuple[list[list[int]], list[list]]:
    """StepOutput's lists per `reqs`: the sampling requests' in order, token 0 with no entry for
    each pooling request (it finishes on it: max_tokens 1, ignore_eos)."""
    sampled = iter(zip(tokens, logprobs))
    merged = [next(sampled) if r.params.pooling is None else ([0], [None]) for r in reqs]
    return [t for t, _ in merged], [lp for _, lp in merged]


def _decodes(req, q: int) -> bool:
    """A lone output token attends as a decode. Prompt tokens always attend as a prompt chunk,
    so that a prompt whose last token is all that is left after a prefix-cache hit gets the bits
    of a full prefill; so do output tokens recomputed together after a preemption."""
    return q == 1 and req.num_computed > len(req.prompt_ids)
