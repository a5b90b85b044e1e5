"""ReplyBuilder's per-token texts (asked for by chat parsers): each reply's text ends with its
released tokens' texts, and everything joins back to the detokenized output."""

from __future__ import annotations

import random
from typing import Any

import pytest

from freetoken.message import DetokenizeMsg
from freetoken.tokenizer.reply import ReplyBuilder

TEXTS = ["Thinking.</think>\n\nHot 🙂 day. Nice weather today.", "Hi<|vision_start|> there é 🤖🤖 x",
         "Let me tag.</think>ok"]


def replies(tok: Any, ids: list[int], cuts: list[int], stops: list[str], eos: int | None = None,
            lps: list[Any] | None = None, **opts: Any) -> list[Any]:
    """Replies to `ids` sent in pieces (cut at `cuts`); the last one ends with stop token `eos`."""
    builder = ReplyBuilder(tok, stops, token_texts=True, **opts)
    bounds = sorted({0, len(ids), *(c for c in cuts if 0 < c < len(ids))})
    lps = lps or [None] * len(ids)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        end = b == len(ids)
        out.append(builder.build(DetokenizeMsg(1, ids[a:b], lps[a:b], finished=end,
                                               matched_stop=eos if end else None)))
        if out[-1].finished:
            break
    return out


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stops", [[], ["eat"], ["🙂 d"], ["gz"], ["x"], ["🤖x"]])
def test_token_texts_partition_the_released_text(qwen35_tokenizer: Any, text: str, stops: list[str]) -> None:
    tok = qwen35_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(20):
        got = replies(tok, ids, rng.sample(range(len(ids) + 1), rng.randint(0, len(ids))), stops)
        for r in got:
            assert r.token_texts is not None and len(r.token_texts) == len(r.token_ids)
            assert r.incremental_output.endswith("".join(r.token_texts))
        if not stops:
            assert "".join(r.incremental_output for r in got) == tok.decode(ids, skip_special_tokens=True)
            assert [t for r in got for t in r.token_ids] == ids


def test_byte_tokens_and_skipped_specials_have_no_text_of_their_own(qwen35_tokenizer: Any) -> None:
    tok = qwen35_tokenizer
    ids = tok.encode("a🤖<|vision_start|>b", add_special_tokens=False)
    assert len(ids) == 6
    got = replies(tok, ids, [], [])
    assert [t for r in got for t in r.token_texts] == ["a", "", "", "🤖", "", "b"]
    assert ReplyBuilder(tok, []).build(DetokenizeMsg(1, ids, [None] * 6, finished=True)).token_texts is None


@pytest.mark.parametrize("include,skip", [(False, True), (False, False), (True, True), (True, False)])
@pytest.mark.parametrize("cuts", [[], [1], [2, 4], [5]])
def test_stop_token_text_with_include_stop_str(qwen35_tokenizer: Any, include: bool, skip: bool, cuts: list[int]) -> None:
    # vLLM's v1 detokenizer decodes the stop token that ended the turn only with
    # include_stop_str_in_output; its text is then empty unless specials are kept.
    tok = qwen35_tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*tok.encode("Hi there 🤖", add_special_tokens=False), eos]
    lps = [f"lp{i}" for i in range(len(ids))]
    got = replies(tok, ids, cuts, [], eos, lps, include_stop_str_in_output=include, skip_special_tokens=skip)
    kept = ids if include else ids[:-1]
    assert "".join(r.incremental_output for r in got) == tok.decode(kept, skip_special_tokens=skip)
    assert [t for r in got for t in r.token_ids] == kept and [lp for r in got for lp in r.logprobs] == lps[: len(kept)]
    assert [r.stop_logprob for r in got][-1] == (None if include else lps[-1])
    assert got[-1].matched_stop == eos
    assert "".join(t for r in got for t in r.token_texts) == "".join(r.incremental_output for r in got)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_in_the_stop_tokens_message(qwen35_tokenizer: Any, include: bool) -> None:
    # vLLM checks stop strings in the text that came with the stop token too; the string wins.
    tok = qwen35_tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*tok.encode("Hello world again", add_special_tokens=False), eos]  # Hello | world | again
    (r,) = replies(tok, ids, [], ["wor"], eos, include_stop_str_in_output=include)
    full = tok.decode(ids, skip_special_tokens=True)
    assert r.incremental_output == full[: full.find("wor") + (3 if include else 0)]
    assert (r.finished, r.finish_reason, r.matched_stop, r.token_ids) == (True, "stop", "wor", ids[:2])


@pytest.mark.parametrize("cuts", [[], [1, 2, 3, 4, 5, 6], [6]])
def test_min_tokens_passes_through(qwen35_tokenizer: Any, cuts: list[int]) -> None:
    tok = qwen35_tokenizer
    ids = tok.encode("Hello, my name is Lee, and I'm a student", add_special_tokens=False)
    full = tok.decode(ids)
    got = replies(tok, ids, cuts, ["e"], min_tokens=5)
    assert "".join(r.incremental_output for r in got) == full[: full.find("e", len(tok.decode(ids[:5])))]
    assert got[-1].matched_stop == "e" and [t for r in got for t in r.token_ids] == ids[:6]  # " Lee"
