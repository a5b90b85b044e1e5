"""Structured outputs in the engine: each request's grammar matcher, compiled off the step loop,
and the masks of the rows it constrains.

- `GrammarCompiler` builds matchers in a small thread pool (llguidance drops the GIL while it
  compiles), keeps the compiled matcher of each (kind, value) and hands each request a copy.
- `RequestGrammar` is one request's matcher: free until the output ends with the spec's
  `after_ids`, then it consumes every token the scheduler appends.
- `GrammarMasks` turns the matchers of a step's rows into banned-token masks for the sampler.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import llguidance
# numpy's helpers, not torch's: llguidance.torch imports torch.compile's stack (seconds).
import llguidance.numpy
import numpy as np
import torch

from freetoken.core import StructuredSpec
from freetoken.structured.grammar import grammar_text

COMPILE_WORKERS = 2
# Compiled matchers kept by (kind, value): tool schemas and a client's response_format repeat.
CACHE_SIZE = 128


def _reason(error: str) -> str:
    # llguidance appends a dump of the parser state to some messages; clients need the reason.
    return error.split("<state>", 1)[0].strip()


class RequestGrammar:
    """One request's grammar: its matcher once compiled, and whether it constrains yet."""

    def __init__(self, spec: StructuredSpec, compiled: Future[llguidance.LLMatcher]):
        self.spec = spec
        self._compiled = compiled
        self.matcher: llguidance.LLMatcher | None = None
        self.error: str | None = None  # why it did not compile
        self.active = not spec.after_ids  # the grammar starts after the marker

    def resolve(self) -> bool:
        """Whether compilation is over, never waiting for it: then `matcher` or `error` is set."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            # A copy: the compiled matcher stays at the start, for the next request.
            self.matcher = self._compiled.result().deep_copy()
        except Exception as exc:
            self.error = f"The structured output grammar does not compile: {_reason(str(exc))}"
        return True

    @property
    def constraining(self) -> llguidance.LLMatcher | None:
        """The matcher, while it decides what the request may sample (None before the marker)."""
        return self.matcher if self.active else None

    def advance(self, output_ids: list[int]) -> str | None:
        """Take the token just appended to `output_ids`; returns an error message when the
        grammar cannot take it (its mask allowed it, so only limits or a ban that emptied the
        row get here)."""
        if not self.active:
            after = self.spec.after_ids
            self.active = tuple(output_ids[-len(after):]) == after  # the marker itself is free
            return None
        assert self.matcher is not None, "a running request's grammar is compiled"
        if self.matcher.consume_token(output_ids[-1]):
            return None
        return ("The output cannot continue under its grammar: "
                + _reason(self.matcher.get_error()))


def wait_any(grammars: list[RequestGrammar], timeout: float) -> None:
    """Block until one of `grammars` has compiled, or `timeout` seconds."""
    wait([g._compiled for g in grammars], timeout, return_when=FIRST_COMPLETED)


class GrammarCompiler:
    """Compiles specs in a thread pool, one compile per (kind, value) while it stays cached.

    `tokenizer` makes llguidance's tokenizer; it is called once, in the pool, on the first
    compile (it walks the vocabulary: about 0.5 s at 49k ids).
    """

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer],
                 workers: int = COMPILE_WORKERS, cache_size: int = CACHE_SIZE):
        self._make_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[llguidance.LLMatcher]] = OrderedDict()
        self._cache_size = cache_size
        self.compiled = 0  # compiles started (cache misses)
        self.cache_hits = 0

    def start(self, spec: StructuredSpec) -> RequestGrammar:
        """The grammar of a new request; its compile (if not cached) runs in the pool."""
        key = (spec.kind, spec.value)
        future = self._cache.get(key)
        if future is None:
            future = self._pool.submit(self._compile, spec)
            self.compiled += 1
        else:
            self.cache_hits += 1
            self._cache.move_to_end(key)
        self._cache[key] = future  # a failed compile is kept too: the spec stays invalid
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return RequestGrammar(spec, future)

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def _compile(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher


class GrammarMasks:
    """Masks of a step's grammar rows from llguidance's bitmasks (one bit per token); counts the
    steps and host seconds spent on them."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self._executor: llguidance.LLExecutor | None = None  # its threads start on first use
        self.steps = 0
        self.seconds = 0.0

    def banned(self, matchers: list[llguidance.LLMatcher | None]) -> torch.Tensor:
        """[len(matchers), V] bool, True where the row's grammar forbids the token (a row
        without a matcher bans nothing). A stopped matcher, or one in an error state, allows
        only EOS, so that its row can end."""
        start = time.perf_counter()
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        # One bit per token, set where allowed; rows without a matcher stay all set.
        bitmask = np.full(llguidance.numpy.get_bitmask_shape(len(matchers), self.vocab_size), -1,
                          dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, m in enumerate(matchers) if m is not None], bitmask)
        # Token 32 w + k is bit k of int32 w: bit k % 8 of byte 4 w + k // 8 (little-endian),
        # which numpy unpacks in that order, 50x faster than a torch gather or shift.
        clear = ~bitmask.view(np.uint8)
        bits = np.unpackbits(clear, axis=1, count=self.vocab_size, bitorder="little")
        banned = torch.from_numpy(bits).view(torch.bool).to(self.device)
        self.steps += 1
        self.seconds += time.perf_counter() - start
        return banned

    def stats(self) -> dict[str, int | float]:
        return {"grammar_mask_steps": self.steps,
                "grammar_mask_us": self.seconds / self.steps * 1e6 if self.steps else 0.0}
