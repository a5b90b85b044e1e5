"""MTP drafting: the checkpoint's multi-token-prediction head (models/qwen3_5.py's
MultiTokenPredictor) proposes the drafts that the engine verifies (scheduler/speculation.py).

The head pairs the main model's final-norm hidden state at position i with token i + 1, and
attends over its own K/V of the pairs before. Pair i is stored in the KV slot of token i + 1,
in a pool layer after the main model's, so that a slot's contents depend on the tokens up to its
own alone, as the main layers' do: what the prefix cache shares, what a preemption releases and
what a rejected draft gives back are the head's K/V too, with nothing to roll back.

Every step also writes the head's K/V of its drafting requests' rows (`MtpPass`, inside the
model's forward; none at all where no running request drafts any more, Req.drafting): the
row of token t pairs it with the main model's state at the position before, which is the
previous row, or for a request's first row the state kept on the request from its last step
(Req.mtp_hidden). The head has one layer, whose K/V depend on its rows alone: the pass attends
nothing. The rows of a rejected draft are written too, in slots the scheduler then frees. After a
prefix-cache hit the state before the first uncached token was never kept, and its pair is made
from a zero state: the drafts of that request are a little off, never its output.

Drafting (`draft`), once the scheduler has given the drafts their slots: the pair of the
request's last token (its state kept from the step before), then k - 1 more, each pairing the
head's own output with the token it drafted (greedy), as vLLM's MTP proposer does. Verification
keeps outputs exact whatever the drafts are; the next step's pass rewrites the pairs of the
accepted tokens with the main model's states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.core import Batch, Req
from freetoken.kvcache.forward_context import ForwardContext


@dataclass
class MtpPass:
    """What the model's forward needs to write the head's K/V of a step's rows."""

    ctx: ForwardContext  # the head's rows: the step's tokens and slots, at the pairs' positions
    carried: torch.Tensor  # [R, hidden] the states kept on the step's requests (zero where none)
    previous_rows: torch.Tensor  # [T] each row's state before it, in cat([hidden, carried])
    hidden: torch.Tensor | None = None  # [T, hidden] the main model's final-norm states, set by it


class MtpDrafter:
    def __init__(self, engine):
        self.engine, self.model = engine, engine.model
        self.zero = torch.zeros(self.model.cfg.hidden_size, dtype=engine.kv.kv[0].dtype, device=engine.device)

    def pass_for(self, batch: Batch, ctx: ForwardContext) -> MtpPass | None:
        """The head's pass over the rows of the step `ctx` runs that belong to requests still
        drafting (Req.drafting); None where there are none."""
        rows = len(ctx.input_ids)
        carried, previous, chosen, row = [], [], [], 0
        for req, new in zip(batch.reqs, batch.new_ids):
            if req.drafting:
                start = req.num_computed - len(new)
                kept = req.mtp_hidden
                carried.append(kept[1] if kept is not None and kept[0] == start - 1 else self.zero)
                previous += [rows + len(carried) - 1, *range(row, row + len(new) - 1)]
                chosen += range(row, row + len(new))
            row += len(new)
        if not chosen:
            return None
        dev = self.engine.device
        ids, positions, slots = ctx.input_ids, ctx.positions, ctx.out_slots
        if len(chosen) < rows:
            index = torch.tensor(chosen, device=dev)
            ids, positions, slots = (t.index_select(0, index) for t in (ids, positions, slots))
        # Pair p is at position p - 1. The pass writes K/V only (a one-layer head's K/V depend
        # on its rows alone): no attention groups.
        head = ForwardContext(
            input_ids=ids, positions=(positions - 1).clamp(min=0), out_slots=slots,
            prompt_groups=[], decode_groups=[],
            logit_rows=torch.empty(0, dtype=torch.long, device=dev), kv_cache=ctx.kv_cache)
        return MtpPass(head, torch.stack(carried), torch.tensor(previous, device=dev))

    @staticmethod
    def keep(batch: Batch, tokens: list[list[int]], step: MtpPass) -> None:
        """After a step: each drafting request keeps the main model's state at its last kept
        row."""
        kept = {id(r): len(t) for r, t in zip(batch.logit_reqs, tokens)}
        row = 0
        for req, new in zip(batch.reqs, batch.new_ids):
            if req.drafting:
                last = kept[id(req)] - 1 if req.drafts else len(new) - 1
                position = req.num_computed - len(new) + last
                req.mtp_hidden = (position, step.hidden[row + last].clone())
            row += len(new)

    @torch.inference_mode()
    def draft(self, reqs: list[Req], lengths: list[int]) -> list[list[int]]:
        """`lengths[i]` greedy drafts of the head for each of `reqs`, whose slots for them (and
        for its last token) are taken."""
        model, engine, dev = self.model, self.engine, self.engine.device
        drafts: list[list[int]] = [[] for _ in reqs]
        members = [i for i, r in enumerate(reqs)
                   if r.mtp_hidden is not None and r.mtp_hidden[0] == len(r.all_ids) - 2]
        state = torch.stack([reqs[i].mtp_hidden[1] for i in members]) if members else None
        tokens = [reqs[i].output_ids[-1] for i in members]
        for j in range(max(lengths, default=0)):
            go_on = [k for k, i in enumerate(members) if lengths[i] > j]
            if not go_on:
                break
            if len(go_on) < len(members):
                state = state.index_select(0, torch.tensor(go_on, device=dev))
                members, tokens = [members[k] for k in go_on], [tokens[k] for k in go_on]
            # Pair p: the token at position p, after the state at p - 1.
            at = [len(reqs[i].all_ids) - 1 + j for i in members]
            ctx = ForwardContext(
                input_ids=torch.tensor(tokens, device=dev), positions=torch.tensor([p - 1 for p in at], device=dev),
                out_slots=torch.tensor([reqs[i].slots[p] for i, p in zip(members, at)], device=dev),
                prompt_groups=[],
                decode_groups=engine._decode_groups([(k, reqs[i].slots[1 : p + 1])
                                                     for k, (i, p) in enumerate(zip(members, at))]),
                logit_rows=torch.empty(0, dtype=torch.long, device=dev), kv_cache=engine.kv.kv)
            state = model.mtp(state, model.model.embed_tokens(ctx.input_ids), ctx)
            tokens = model.lm_head(state).argmax(dim=-1).tolist()
            for i, token in zip(members, tokens):
                drafts[i].append(token)
        return drafts
