"""Turn the engine's per-step token messages into text replies (shared by server and LLM)."""

from __future__ import annotations

from freetoken.core import TokenLogprob
from freetoken.message import DetokenizeMsg, UserReply
from freetoken.tokenizer.detokenize import IncrementalDetokenizer


class ReplyBuilder:
    """One per request: detokenizes, cuts stop strings, and pairs released text with the
    tokens (and logprob entries) behind it; with `token_texts`, also each token's text.

    Output controls as vLLM's: `include_stop_str_in_output` also keeps the text of the stop
    token that ended the turn (released then as an ordinary token, with its logprob entry in
    `logprobs`, not `stop_logprob`); `min_tokens` keeps stop strings from ending the text of
    the first output tokens; `spaces_between_special_tokens=False` only matters where the
    decoder puts a space before an added token (WordPiece, not byte-level BPE).
    """

    def __init__(self, tokenizer, stop_strs: list[str], skip_special_tokens: bool = True,
                 token_texts: bool = False, *, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0, spaces_between_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(
            tokenizer, stop_strs=stop_strs, skip_special_tokens=skip_special_tokens,
            include_stop_str_in_output=include_stop_str_in_output, min_tokens=min_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens)
        self._include_stop = include_stop_str_in_output
        # Sampled tokens whose text is not released yet, with their logprob entries.
        self.pending: list[tuple[int, TokenLogprob | None]] = []
        self._token_texts = token_texts

    def build(self, msg: DetokenizeMsg) -> UserReply:
        """The reply for `msg`; `finished` is also set when a stop string matched, in which
        case the caller must abort the engine's request."""
        pairs = list(zip(msg.token_ids, msg.logprobs))
        stop_logprob = None
        if msg.matched_stop is not None and not self._include_stop:
            stop_logprob = pairs.pop()[1]  # the EOS / stop token ends the turn: it has no text
        self.pending += pairs
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
            token_ids=[t for t, _ in released],
            logprobs=[lp for _, lp in released],
            stop_logprob=stop_logprob,
            token_texts=step.shares() if self._token_texts else None,
            prompt_logprobs=msg.prompt_logprobs,
            embedding=msg.embedding,
        )
