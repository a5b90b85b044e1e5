"""Logprob entries in the two OpenAI shapes: legacy completions and chat `content` lists."""

from __future__ import annotations

from freetoken.core import TokenLogprob
from freetoken.tokenizer.detokenize import TokenTexts

MIN_LOGPROB = -9999.0  # OpenAI's "very unlikely"; JSON has no -inf


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def token_label(texts: TokenTexts | None, token_id: int, as_ids: bool) -> str:
    if as_ids or texts is None:
        return f"token_id:{token_id}"
    return texts.text(token_id)


def completion_logprobs(
    entries: list[TokenLogprob | int], texts: TokenTexts | None, as_ids: bool, offset: int = 0
) -> tuple[dict, int]:
    """The legacy `{tokens, token_logprobs, top_logprobs, text_offset}` object, and the offset
    after it (so streamed chunks continue where the previous one stopped, as vLLM does).

    A bare token id is an echoed prompt's first token: nothing precedes it, so its logprob and
    top logprobs are null (OpenAI's and vLLM's shape)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        if isinstance(e, int):
            token = token_label(texts, e, as_ids)
            out["tokens"].append(token)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(offset)
            offset += len(token)
            continue
        token = token_label(texts, e.token_id, as_ids)
        # The sampled token first, then the top K: K or K+1 keys, as vLLM.
        top = {token: clamp(e.logprob)}
        for tid, lp in zip(e.top_ids, e.top_logprobs):
            top.setdefault(token_label(texts, tid, as_ids), clamp(lp))
        out["tokens"].append(token)
        out["token_logprobs"].append(clamp(e.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(token)
    return out, offset


def chat_entries(entries: list[TokenLogprob], texts: TokenTexts | None, as_ids: bool) -> list[dict]:
    """Chat `logprobs.content` items; `bytes` are always the token's real UTF-8 bytes."""

    def one(token_id: int, logprob: float) -> dict:
        raw = texts.bytes(token_id) if texts is not None else b""
        return {"token": token_label(texts, token_id, as_ids), "logprob": clamp(logprob), "bytes": list(raw)}

    return [
        {**one(e.token_id, e.logprob),
         "top_logprobs": [one(t, lp) for t, lp in zip(e.top_ids, e.top_logprobs)]}
        for e in entries
    ]


def prompt_items(prompt_ids: list[int], entries: list[TokenLogprob | None]) -> list[TokenLogprob | int]:
    """Prompt logprob entries as `completion_logprobs` takes them: the first token as its bare
    id (it has no logprob), the rest as they are."""
    return [prompt_ids[0], *entries[1:]]


def vllm_prompt_logprobs(entries: list[TokenLogprob | None], texts: TokenTexts | None) -> list:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or `{id: {logprob, rank,
    decoded_token}}` holding the prompt token, then the top K."""

    def one(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": clamp(logprob), "rank": rank,
                "decoded_token": texts.text(token_id) if texts is not None else ""}

    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        position = {str(e.token_id): one(e.token_id, e.logprob, e.rank)}
        for rank, (tid, lp) in enumerate(zip(e.top_ids, e.top_logprobs), 1):
            position.setdefault(str(tid), one(tid, lp, rank))
        out.append(position)
    return out
