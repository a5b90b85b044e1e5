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


def replies(tok: Any, ids: list[int], cuts: list[int], stops: list[str]) -> list[Any]:
    builder = ReplyBuilder(tok, stops, token_texts=True)
    bounds = sorted({0, len(ids), *(c for c in cuts if 0 < c < len(ids))})
    out = []
    for a, b in zip(bounds, bounds[1:]):
        out.append(builder.build(DetokenizeMsg(1, ids[a:b], [None] * (b - a),
                                               finished=b == len(ids))))
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
