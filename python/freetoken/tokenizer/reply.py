"""Turn the engine's per-step token messages into text replies (shared by server and LLM)."""

from __future__ import annotations

from freetoken.core import TokenLogprob
from freetoken.message import DetokenizeMsg, UserReply
from freetoken.tokenizer.detokenize import IncrementalDetokenizer


class ReplyBuilder:
    """One per request: detokenizes, cuts stop strings, and pairs released text with the
    tokens (and logprob entries) behind it; with `token_texts`, also each token's text."""

    def __init__(self, tokenizer, stop_strs: list[str], skip_special_tokens: bool = True,
                 token_texts: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer, stop_strs=stop_strs,
                                            skip_special_tokens=skip_special_tokens)
        # Sampled tokens whose text is not released yet, with their logprob entries and where
        # their text ends in the whole output.
        self.pending: list[tuple[int, TokenLogprob | None, int]] = []
        # A stop-free twin fed one token at a time: the text each token completes.
        self._twin = (IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
                      if token_texts else None)
        self._done = 0  # characters completed by the tokens fed so far
        self._shown = 0  # characters released so far
        self._start = 0  # where the text of the first pending token starts

    def build(self, msg: DetokenizeMsg) -> UserReply:
        """The reply for `msg`; `finished` is also set when a stop string matched, in which
        case the caller must abort the engine's request."""
        pairs = list(zip(msg.token_ids, msg.logprobs))
        stop_logprob = None
        if msg.matched_stop is not None:  # the EOS / stop token ends the turn: it has no text
            stop_logprob = pairs.pop()[1]
        for t, lp in pairs:
            if self._twin is not None:
                self._done += len(self._twin.step([t], finished=False).text)
            self.pending.append((t, lp, self._done))
        if self._twin is not None and msg.finished and self.pending:
            tail = len(self._twin.step([], finished=True).text)  # a dangling partial character
            t, lp, end = self.pending[-1]
            self.pending[-1] = (t, lp, end + tail)
        step = self.detok.step([t for t, _ in pairs], finished=msg.finished)
        released = self.pending[: step.released]
        self.pending = self.pending[step.released + step.dropped :]
        stopped = step.stopped is not None
        return UserReply(
            msg.uid,
            incremental_output=step.text,
            finished=msg.finished or stopped,
            finish_reason="stop" if stopped else msg.finish_reason,
            prompt_tokens_delta=msg.prompt_tokens,
            completion_tokens_delta=len(msg.token_ids),
            cached_tokens=msg.cached_tokens,
            matched_stop=step.stopped if stopped else msg.matched_stop,
            token_ids=[t for t, _, _ in released],
            logprobs=[lp for _, lp, _ in released],
            stop_logprob=stop_logprob,
            token_texts=self._texts(step.text, released) if self._twin is not None else None,
        )

    def _texts(self, text: str, released: list[tuple[int, TokenLogprob | None, int]]) -> list[str]:
        """Each released token's part of `text`, the released span [shown, shown + len(text)):
        its own text cut to that span; the last one also takes any rest of the span."""
        lo, hi = self._shown, self._shown + len(text)
        self._shown = hi
        pieces, start = [], self._start
        for _, _, end in released:
            a, b = min(max(start, lo), hi), min(max(end, lo), hi)
            pieces.append(text[a - lo : b - lo])
            start = end
        if released:
            pieces[-1] += text[min(max(start, lo), hi) - lo :]
            self._start = start
        return pieces
