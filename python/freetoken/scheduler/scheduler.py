"""Continuous batching: admit, prefill in chunks under a token budget, decode, preempt, finish.

Each `step()` runs one forward: a prefill batch when prompts are waiting (prefill first, as
upstream), otherwise one decode batch over every running request. New requests and aborts
join between steps.

KV is allocated as tokens are computed, not reserved up front for `max_tokens`: a request is
admitted when its uncomputed tokens and the token it then samples fit beside what the running
requests need for their next step. When a decode step finds the pool full, the most recently
admitted request is preempted (vLLM's and SGLang's recompute): its slots are released and it
waits at the front of the queue, keeping its output and generator, to prefill its prompt and
output again once it fits.

A request that asks for prompt logprobs skips the prefix cache: each prefill chunk also scores
its prompt tokens, and the entries go out with its first message.

A request with a grammar (params.structured) waits until its matcher has compiled in the
compiler's thread pool; the requests behind it go ahead meanwhile. Its matcher consumes each
token as it is appended here, never in the forward, so a re-run step cannot feed it twice.

A step that raises is run again request by request, so that only the requests that fail alone
fail: KV writes of a re-run are idempotent and the forward is batch-invariant in float32.

Hybrid (linear-attention) models also hold a recurrent-state slot per running request and
snapshots in the prefix cache; scheduler/states.py is their side of it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice

from freetoken.config import SpeculativeConfig
from freetoken.core import Batch, Req
from freetoken.engine import pooling
from freetoken.engine.engine import Engine, StepOutput
from freetoken.message import DetokenizeMsg, UserMsg
from freetoken.scheduler.cache import PrefixCache
from freetoken.scheduler.speculation import Speculator, speculates
from freetoken.scheduler.states import RecurrentStates, SnapshotCache
from freetoken.structured.matcher import GrammarCompiler, wait_any

log = logging.getLogger("freetoken")

# Prompt tokens scored for prompt logprobs per step: each is a logit row over the vocabulary
# (about 1 MB at 248k ids, and a log-softmax of the same size).
PROMPT_LOGPROB_ROWS = 256

# A seed is a non-negative signed 64-bit integer (torch's manual_seed would remap a negative one,
# or raise past 2**64).
_SEED_LIMIT = 2**63

# A step with nothing to run but grammars compiling waits this long for one, then returns so
# that the worker can take new requests: spinning would take a core from the compile.
GRAMMAR_IDLE_WAIT_S = 0.005


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048
    prefix_cache: bool = True
    speculative: SpeculativeConfig | None = None


class Scheduler:
    def __init__(self, engine: Engine, config: SchedulerConfig, grammars: GrammarCompiler):
        self.engine, self.config, self.grammars = engine, config, grammars
        self.cache = PrefixCache(engine.kv) if config.prefix_cache else None
        self.states = None  # hybrid models' recurrent states (scheduler/states.py)
        if engine.states is not None:
            self.cache = SnapshotCache(engine.kv, engine.states) if config.prefix_cache else None
            self.states = RecurrentStates(engine.states, self.cache)
        # Drafts need a model whose rows can each run as a decode step (not the scripted test
        # model).
        self.speculator = (Speculator(config.speculative) if config.speculative is not None
                           and getattr(engine.model, "verifies_drafts", False) else None)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # in order of admission
        self.compiling: list[Req] = []  # waiting requests whose grammar is not compiled yet
        self.preemptions = 0
        # Prompt tokens looked up in the prefix cache at admission, and those found (vLLM's).
        self.prefix_queries = self.prefix_hits = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict[str, int | float | str | dict[str, str] | dict[str, int]]:
        plan = getattr(self.engine.model, "kernel_plan", None)
        return {"running": len(self.running), "waiting": len(self.waiting),
                # A model without a plan has no linear layers (the scripted test model).
                "batch_invariant": int(plan is None or plan.invariant),
                "linear_kernels": plan.kernels if plan is not None else {},
                # How a GGUF's kept blocks multiply (--quantized-arithmetic): exact or int8.
                "quantized_arithmetic": getattr(self.engine.model, "quantized_arithmetic", "exact"),
                # Every op's kernel (kernels/plan.py); empty for a model without a plan.
                "kernel_plan": plan.stats if plan is not None else {},
                # By format: a GGUF's block formats as stored, the other weights by dtype.
                "weight_bytes": getattr(self.engine.model, "weight_bytes", {}),
                "kv_free": self.engine.kv.num_free, "kv_total": self.engine.kv.num_slots,
                "kv_used": self.engine.kv.num_used, "prefix_cache_queries": self.prefix_queries,
                "prefix_cache_hits": self.prefix_hits, "preemptions": self.preemptions,
                "grammar_compiling": len(self.compiling),
                "grammar_compiles": self.grammars.compiled,
                "grammar_cache_hits": self.grammars.cache_hits,
                **self.engine.sampler.grammar_masks.stats(),
                **(self.states.stats() if self.states else {}),
                **({"spec_decode_method": self.speculator.config.method, **vars(self.speculator.stats)}
                   if self.speculator else {})}

    def add(self, msg: UserMsg) -> list[DetokenizeMsg]:
        """Queue a request, or answer it with an error reply: this never raises for a request."""
        params, n, uid = msg.sampling_params, len(msg.input_ids), msg.uid
        limit, pool = self.config.max_model_len, self.engine.kv.num_slots
        if n >= limit:
            return [_error(uid, f"This model's maximum context length is {limit} tokens, "
                           f"but the prompt has {n} tokens.", "context_length_exceeded")]
        if params.max_tokens is None:
            # At least 1, so that a prompt that fills the pool is refused below.
            params.max_tokens = max(min(limit, pool) - n, 1)
        max_tokens = params.max_tokens
        if n + max_tokens > limit:
            return [_error(uid, f"'max_tokens' or 'max_completion_tokens' is too large: "
                           f"{max_tokens}. This model's maximum context length is {limit} tokens "
                           f"and your request has {n} input tokens ({max_tokens} > {limit} - {n}).",
                           "context_length_exceeded")]
        # A request alone must always fit, or preempting the others would never make room.
        if n + max_tokens > pool:
            return [_error(uid, f"The request needs {n + max_tokens} KV cache slots ({n} input "
                           f"tokens + {max_tokens} max_tokens) but the KV cache holds {pool} "
                           f"tokens (--kv-cache-tokens).", "context_length_exceeded")]
        invalid = self._invalid(msg)
        if invalid:
            return [_error(uid, invalid, "invalid_request")]
        req = Req(uid=uid, prompt_ids=list(msg.input_ids), params=params,
                  generator=self.engine.new_generator(params),
                  drafting=self.speculator is not None and speculates(params),
                  prompt_logprobs=None if params.prompt_logprobs is None else [None])
        if params.structured is not None:
            req.grammar = self.grammars.start(params.structured)
            self.compiling.append(req)
        self.waiting.append(req)
        return []

    def _invalid(self, msg: UserMsg) -> str | None:
        """What in `msg` would make torch raise (or, on CUDA, assert) inside a step."""
        params, vocab = msg.sampling_params, self.engine.sampler.vocab_size
        if not msg.input_ids:
            return "The prompt is empty."
        if params.seed is not None and not (
            isinstance(params.seed, int) and 0 <= params.seed < _SEED_LIMIT
        ):
            return f"'seed' must be an integer in [0, 2**63), got {params.seed!r}."
        for name, ids in (("prompt", msg.input_ids),
                          ("allowed_token_ids", params.allowed_token_ids),
                          ("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", list(params.logit_bias or ())),
                          ("bad_words", [t for word in params.bad_words_token_ids for t in word])):
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                return f"'{name}' has token ids outside the vocabulary [0, {vocab})."
        if not all(params.bad_words_token_ids):
            return "'bad_words' has a word of no tokens."
        if params.pooling is not None and not self.engine.can_pool:
            return "This model cannot be pooled for embeddings."
        return None

    def abort(self, uid: int) -> list[DetokenizeMsg]:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.uid == uid:
                    queue.remove(req)
                    self._release(req)
                    self.compiling = [r for r in self.compiling if r is not req]
                    return [DetokenizeMsg(uid, finished=True, finish_reason="abort")]
        return []

    def step(self) -> list[DetokenizeMsg]:
        replies = self._resolve_grammars() if self.compiling else []
        self._admit()
        start = time.perf_counter()
        prefill = self._prefill_batch()
        batch = prefill or self._decode_batch()
        if batch is None:
            self.engine.idle()
            if self.compiling:
                wait_any([r.grammar for r in self.compiling], GRAMMAR_IDLE_WAIT_S)
            return replies
        rows = sum(1 + len(r.drafts) for r in batch.reqs)
        done, failed = self._forward(batch)
        replies += failed
        before = len(replies)
        for part, out in done:
            if self.states:
                self.states.after_step(part)
            scored = iter(out.prompt_logprobs)
            for req, n in part.prompt_rows:
                req.prompt_logprobs += islice(scored, n)
            if self.cache is not None:
                for req in part.logit_reqs:
                    if not req.output_ids:  # its prompt's KV is complete as of this step
                        self.cache.insert(req.prompt_ids, req.slots[: len(req.prompt_ids)])
            for req, tokens, logprobs in zip(part.logit_reqs, out.tokens, out.logprobs):
                replies += self._emit(req, tokens, logprobs)
        if self.speculator is not None and prefill is None and not failed:
            self.speculator.observe(rows, time.perf_counter() - start, len(replies) - before)
        return replies

    def _emit(self, req: Req, tokens: list[int], logprobs: list) -> list[DetokenizeMsg]:
        """Append a step's tokens until one finishes the request; a verified draft gives back
        the slots of the rows it did not keep."""
        drafts, req.drafts, replies = req.drafts, [], []
        for token, logprob in zip(tokens, logprobs):
            replies.append(self._append(req, token, logprob))
            if replies[-1].finished:
                break
        if drafts:
            # Drafts accepted past a token that finished the request are not counted.
            self.speculator.verified(req, drafts, min(len(tokens) - 1, len(replies)), len(replies))
        if replies[-1].finished:
            return replies
        kept = len(req.prompt_ids) + len(req.output_ids) - 1  # not all_ids: a copy of both lists
        if len(req.slots) > kept:
            self.engine.kv.release(req.slots[kept:])
            del req.slots[kept:]
        return replies

    def _resolve_grammars(self) -> list[DetokenizeMsg]:
        """Refuse the requests whose grammar failed to compile (never admitted: they wait)."""
        replies = []
        for req in [r for r in self.compiling if r.grammar.resolve()]:
            self.compiling.remove(req)
            if req.grammar.error is not None:
                self.waiting.remove(req)
                replies.append(_error(req.uid, req.grammar.error, "invalid_request"))
        return replies

    def _forward(
        self, batch: Batch
    ) -> tuple[list[tuple[Batch, StepOutput]], list[DetokenizeMsg]]:
        """Run `batch`; if it raises, run each of its requests alone, and fail those that raise
        alone. Returns the batches that ran with their outputs, and the error replies."""
        # A re-run must not find a seeded stream advanced by the failed run's draws (an unseeded
        # stream cannot tell, and greedy rows draw nothing).
        seeded = [(r.generator, r.generator.get_state()) for r in batch.logit_reqs
                  if r.params.seed is not None and not r.params.is_greedy]
        try:
            return [(batch, self.engine.forward_batch(batch))], []
        except Exception as exc:
            if len(batch.reqs) == 1:
                [req] = batch.reqs
                log.exception("Request %s failed in the engine", req.uid)
                self._finish(req)
                return [], [_error(req.uid, f"The engine failed on this request: "
                                   f"{type(exc).__name__}: {exc}", "engine_error")]
            log.exception("A step of %d requests failed; running each alone", len(batch.reqs))
        for generator, state in seeded:
            generator.set_state(state)
        done, failed = [], []
        for req, new_ids in zip(batch.reqs, batch.new_ids):
            d, f = self._forward(Batch([req], [new_ids], [r for r in batch.logit_reqs if r is req],
                                       [(r, n) for r, n in batch.prompt_rows if r is req]))
            done += d
            failed += f
        return done, failed

    def _fits(self, n: int) -> bool:
        """Whether `n` slots are free, after evicting prefix-cache leaves if need be."""
        short = n - self.engine.kv.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return n <= self.engine.kv.num_free

    def _admit(self) -> None:
        if not self.waiting:
            return
        # Slots the running requests need to reach their next sample.
        need = sum(r.num_pending for r in self.running)
        held = []
        while self.waiting and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if req.grammar is not None and req.grammar.matcher is None:
                held.append(self.waiting.popleft())  # still compiling: the next ones go on
                continue
            # A prompt scored for prompt logprobs is computed from the position that scores its
            # first scored token: a cached position has no logits, and recomputing it gives the
            # exact ones (as vLLM). Its KV is still cached. (A match never takes the last id.)
            scored, first = req.prompt_logprobs is not None, req.params.prompt_logprobs_from
            reusable = req.all_ids if not scored else req.prompt_ids[:first] if first > 1 else []
            looked_up = self.cache is not None and bool(reusable) \
                and not pooling.needs_every_position(req.params)
            if looked_up:
                # After a preemption the output so far is recomputed too; it may hit the cache.
                req.slots, hit = self.cache.match(reusable)
                if not req.output_ids:  # reported on the first message only
                    req.cached_tokens = hit
            if scored:  # entries from the first scored token; a readmitted request starts over
                req.prompt_logprobs = [None] * first
            # +1: the KV of the token it samples, written by its first decode step.
            if not self._fits(need + req.num_pending + 1):
                self._release(req)
                break  # stays queued until running requests free their slots
            if looked_up:  # counted once admitted: a request that waits is looked up again
                self.prefix_queries += len(reusable)
                self.prefix_hits += hit
            need += req.num_pending + 1
            self.waiting.popleft()
            self.running.append(req)
            if self.states:
                self.states.admit(req, len(req.slots))
        self.waiting.extendleft(reversed(held))  # back in their places

    def _take(self, req: Req, n: int) -> None:
        req.slots += self.engine.kv.allocate(n)

    def _prefill_batch(self) -> Batch | None:
        budget, score_budget = self.config.max_prefill_tokens, PROMPT_LOGPROB_ROWS
        reqs, new_ids, logit_reqs, prompt_rows = [], [], [], []
        for req in self.running:
            left = req.num_pending
            # One token left after sampling is a decode; a readmitted request has more.
            if budget <= 0 or (left == 1 and req.output_ids):
                continue
            size = min(left, budget)
            if self.states:
                size = self.states.chunk_size(req.num_computed, size, left)
            done = req.num_computed
            # A chunk's scored rows start at its first token: one that reaches the first scored
            # row stops before it, and the next starts there.
            unscored = req.params.prompt_logprobs_from - 1 - done
            scoring = req.prompt_logprobs is not None and unscored <= 0
            if scoring:
                # Each scored token is a vocabulary-wide logit row: bound how many one step makes.
                if score_budget <= 0:
                    continue
                size = min(size, score_budget)
                score_budget -= size
            elif req.prompt_logprobs is not None:
                size = min(size, unscored)
            chunk = req.all_ids[done : done + size]
            budget -= len(chunk)
            if self.states:
                self.states.plan_snapshots(req, done, len(chunk))
            self._take(req, len(chunk))
            reqs.append(req)
            new_ids.append(chunk)
            if req.num_pending == 0:
                logit_reqs.append(req)
            if scoring:
                # Every chunk token but the prompt's last is followed by a prompt token.
                scored = min(len(chunk), len(req.prompt_ids) - 1 - done)
                if scored > 0:
                    prompt_rows.append((req, scored))
        return Batch(reqs, new_ids, logit_reqs, prompt_rows) if reqs else None

    def _decode_batch(self) -> Batch | None:
        # Prefill runs first, so every running request decodes and needs one slot; the newest
        # give theirs up until the older ones fit.
        while not self._fits(len(self.running)):
            self._preempt(self.running[-1])
        reqs = list(self.running)
        for req in reqs:
            self._take(req, 1)
        if self.speculator is not None and reqs:
            self._draft(reqs)
        return Batch(reqs, [[r.output_ids[-1], *r.drafts] for r in reqs], reqs) if reqs else None

    def _draft(self, reqs: list[Req]) -> None:
        """Give the decoding `reqs` their drafts, in free slots only: drafts never preempt anyone;
        none in a step the measured choice runs plain; prompt-lookup drafts to one request only
        while the step cost is not known (scheduler/speculation.py)."""
        speculator = self.speculator
        if not speculator.mode.drafts(len(reqs)):
            speculator.rest(reqs)
            return
        if speculator.config.method == "ngram":
            one = not speculator.cost.known
            for req in reqs:
                drafts = speculator.propose(req, len(reqs))
                if drafts and self._fits(len(drafts)):
                    req.drafts = drafts
                    self._take(req, len(drafts))
                    if one:
                        break
            return
        # The MTP head drafts into the slots its drafts take (engine/mtp.py): taken first.
        drafting = []
        for req in reqs:
            n = speculator.length(req, len(reqs))
            if n and self._fits(n):
                self._take(req, n)
                drafting.append((req, n))
        if drafting:
            found = self.engine.drafter.draft([r for r, _ in drafting], [n for _, n in drafting])
            for (req, n), drafts in zip(drafting, found):
                req.drafts, unused = drafts, n - len(drafts)  # none where no state was kept
                if unused:
                    self.engine.kv.release(req.slots[-unused:])
                    del req.slots[-unused:]

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self._release(req)
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _append(self, req: Req, token: int, logprob) -> DetokenizeMsg:
        params = req.params
        req.output_ids.append(token)
        error = req.grammar.advance(req.output_ids) if req.grammar else None
        if error is not None:
            self._finish(req)
            return _error(req.uid, error, "invalid_request")
        msg = DetokenizeMsg(req.uid, token_ids=[token], logprobs=[logprob])
        if len(req.output_ids) == 1:
            msg.prompt_tokens, msg.cached_tokens = len(req.prompt_ids), req.cached_tokens
            # Handed over, not kept: the request no longer holds a long prompt's entries.
            msg.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
            if req.params.pooling is not None:
                msg.embedding = pooling.pooled(req)
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.config.eos_token_ids
        ):
            msg.finish_reason, msg.matched_stop = "stop", token
        elif len(req.output_ids) >= params.max_tokens:
            msg.finish_reason = "length"
        if msg.finish_reason is not None:
            msg.finished = True
            self._finish(req)
        return msg

    def _finish(self, req: Req) -> None:
        self.running.remove(req)
        self._release(req)

    def _release(self, req: Req) -> None:
        self.engine.kv.release(req.slots)
        req.slots, req.drafts = [], []
        if self.states:
            self.states.release(req)


def _error(uid: int, message: str, code: str) -> DetokenizeMsg:
    return DetokenizeMsg(uid, finished=True, finish_reason="error", error=message, error_code=code)
