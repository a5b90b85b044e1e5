"""Continuous batching: admit, prefill in chunks under a token budget, decode, finish.

Each `step()` runs one forward: a prefill batch when prompts are waiting (prefill first, as
upstream), otherwise one decode batch over every running request. New requests and aborts
join between steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from freetoken.core import Batch, Req
from freetoken.engine.engine import Engine
from freetoken.message import DetokenizeMsg, UserMsg
from freetoken.scheduler.cache import PrefixCache


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048
    prefix_cache: bool = True


class Scheduler:
    def __init__(self, engine: Engine, config: SchedulerConfig):
        self.engine, self.config = engine, config
        self.cache = PrefixCache(engine.kv) if config.prefix_cache else None
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.generators: dict[int, torch.Generator] = {}
        # KV slots promised to running requests but not yet allocated (their future tokens).
        self.reserved = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict[str, int]:
        return {"running": len(self.running), "waiting": len(self.waiting),
                "kv_free": self.engine.kv.num_free, "kv_total": self.engine.kv.num_slots}

    def add(self, msg: UserMsg) -> list[DetokenizeMsg]:
        params, n = msg.sampling_params, len(msg.input_ids)
        limit = self.config.max_model_len
        if n >= limit:
            return [_error(msg.uid, f"This model's maximum context length is {limit} tokens, "
                           f"but the prompt has {n} tokens.", "context_length_exceeded")]
        params.max_tokens = min(params.max_tokens, limit - n)
        if n + params.max_tokens > self.engine.kv.num_slots:
            return [_error(msg.uid, f"The request needs {n + params.max_tokens} KV slots; the pool "
                           f"has {self.engine.kv.num_slots}.", "context_length_exceeded")]
        self.waiting.append(Req(uid=msg.uid, prompt_ids=list(msg.input_ids), params=params))
        return []

    def abort(self, uid: int) -> list[DetokenizeMsg]:
        for req in [r for r in self.waiting if r.uid == uid]:
            self.waiting.remove(req)
            return [DetokenizeMsg(uid, finished=True, finish_reason="abort")]
        for req in [r for r in self.running if r.uid == uid]:
            self._finish(req)
            return [DetokenizeMsg(uid, finished=True, finish_reason="abort")]
        return []

    def step(self) -> list[DetokenizeMsg]:
        self._admit()
        batch = self._prefill_batch() or self._decode_batch()
        if batch is None:
            return []
        generators = [self.generators[r.uid] for r in batch.logit_reqs]
        out = self.engine.forward_batch(batch, generators)
        if self.cache is not None:
            for req in batch.logit_reqs:
                if not req.output_ids:  # its prompt's KV is complete as of this step
                    self.cache.insert(req.prompt_ids, req.slots[: len(req.prompt_ids)])
        return [
            self._append(req, token, logprob)
            for req, token, logprob in zip(batch.logit_reqs, out.token_ids, out.logprobs)
        ]

    def _need(self, req: Req) -> int:
        return len(req.prompt_ids) + req.params.max_tokens - req.cached_tokens

    def _admit(self) -> None:
        kv = self.engine.kv
        while self.waiting and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if self.cache is not None:
                req.slots, req.cached_tokens = self.cache.match(req.prompt_ids)
            need = self._need(req)
            if need > kv.num_free - self.reserved and self.cache is not None:
                self.cache.evict(need - (kv.num_free - self.reserved))
            if need > kv.num_free - self.reserved:
                if req.slots:
                    kv.release(req.slots)
                    req.slots, req.cached_tokens = [], 0
                break  # stays queued until running requests free their slots
            self.waiting.popleft()
            self.reserved += need
            self.running.append(req)
            self.generators[req.uid] = self.engine.new_generator(req.params)

    def _take(self, req: Req, n: int) -> None:
        req.slots += self.engine.kv.allocate(n)
        self.reserved -= n

    def _prefill_batch(self) -> Batch | None:
        budget = self.config.max_prefill_tokens
        reqs, new_ids, logit_reqs = [], [], []
        for req in self.running:
            done = req.num_computed
            left = len(req.prompt_ids) - done
            if left <= 0 or budget <= 0:
                continue
            chunk = req.prompt_ids[done : done + min(left, budget)]
            budget -= len(chunk)
            self._take(req, len(chunk))
            reqs.append(req)
            new_ids.append(chunk)
            if req.num_computed == len(req.prompt_ids):
                logit_reqs.append(req)
        return Batch(reqs, new_ids, logit_reqs) if reqs else None

    def _decode_batch(self) -> Batch | None:
        reqs = [r for r in self.running if r.output_ids]
        for req in reqs:
            self._take(req, 1)
        return Batch(reqs, [[r.output_ids[-1]] for r in reqs], reqs) if reqs else None

    def _append(self, req: Req, token: int, logprob) -> DetokenizeMsg:
        params = req.params
        req.output_ids.append(token)
        msg = DetokenizeMsg(req.uid, token_ids=[token], logprobs=[logprob])
        if len(req.output_ids) == 1:
            msg.prompt_tokens, msg.cached_tokens = len(req.prompt_ids), req.cached_tokens
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
        self.generators.pop(req.uid, None)
        # Whatever was promised but never allocated goes back to the pool's budget.
        self.reserved -= self._need(req) - (req.num_computed - req.cached_tokens)
        self.engine.kv.release(req.slots)
        req.slots = []


def _error(uid: int, message: str, code: str) -> DetokenizeMsg:
    return DetokenizeMsg(uid, finished=True, finish_reason="error", error=message, error_code=code)
