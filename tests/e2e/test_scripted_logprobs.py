"""Completions and plain chat logprobs on scripted models, against their closed form (issue 5).

`scripted_server` serves the default script (A = 10, </think> 8, "\\n\\n" 6, base 0, V =
248,320). `plain_server` serves chat_scripts() with no parser (A = 9, same alternatives, base
-inf: past the three named ids every logprob is -inf). Each completions request is also streamed,
and the streamed logprobs must join to the non-streamed object.
"""

from __future__ import annotations

import math

import pytest

from tests.fixtures import build_models as bm
from tests.support.bpe import positions, token_bytes
from tests.support.chat import chat_scripts
from tests.support.scripted_logits import ClosedForm, as_id, assert_entries, chat_triples
from tests.support.sse import assert_completion_stream_joins, chat_view, merge_chat_stream, sse

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scripted_server(server, scripted_model_path):
    """The default script; auto picks the qwen3 reasoning and hermes tool parsers."""
    return server("--model", str(scripted_model_path))


@pytest.fixture(scope="module")
def plain_server(server, chat_model_path):
    """chat_model_path with no parser at all."""
    return server("--model", str(chat_model_path), "--reasoning-parser", "off",
                  "--tool-call-parser", "off")


EOS = bm.QWEN_IDS["<|im_end|>"]
EMOJI_TEXT = "Thinking.</think>\n\nHot 🙂 day. Nice weather today."
AS_IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def default_form(scripted_model_path):
    return ClosedForm.of(scripted_model_path)


@pytest.fixture(scope="module")
def plain_form(chat_model_path):
    return ClosedForm.of(chat_model_path)


@pytest.fixture(scope="module")
def emoji_ids(qwen35_tokenizer):
    return chat_scripts(qwen35_tokenizer)["[emoji]"]


def complete(server, prompt: str, extra: dict | None = None, **native) -> dict:
    """The non-streamed choice (openai client), after checking that the streamed chunks'
    text and logprobs join to it."""
    full = server.client().completions.create(model=None, prompt=prompt, extra_body=extra, **native)
    choice = full.choices[0].model_dump()
    events = sse(server, "/v1/completions", {"prompt": prompt, **native, **(extra or {})})
    assert_completion_stream_joins(events, choice)
    return choice


def completion_triples(lp: dict) -> list[tuple]:
    """Completions logprobs (token-id labels) as (id, logprob, [(id, logprob) of the dict])."""
    return [(as_id(t), v, [(as_id(k), x) for k, x in top.items()])
            for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


def completion_entry(form: ClosedForm, t: int, sampled: int, k: int) -> tuple:
    """The sampled token first, then the top k: k entries if it is among them, else k + 1."""
    top = form.top(t, k)
    first = (sampled, form.logprob(t, sampled))
    return sampled, first[1], [first, *(x for x in top if x[0] != sampled)]


def test_completion_values_per_position(scripted_server, default_form, qwen35_tokenizer):
    tok = qwen35_tokenizer
    ids = tok.encode(bm.DEFAULT_SCRIPT[-1]["text"], add_special_tokens=False)
    body = {"max_tokens": 30, "temperature": 0, "logprobs": 2}
    choice = complete(scripted_server, "hi", AS_IDS, **body)
    assert choice["text"] == bm.DEFAULT_SCRIPT[-1]["text"] and choice["finish_reason"] == "stop"
    # The EOS that ends the turn is listed last.
    assert_entries(completion_triples(choice["logprobs"]),
                   [completion_entry(default_form, t, t, 2) for t in [*ids, EOS]])

    lp = complete(scripted_server, "hi", **body)["logprobs"]  # text labels and offsets
    assert lp["tokens"] == [tok.decode([t]) for t in [*ids, EOS]]
    assert "".join(lp["tokens"][:-1]) == choice["text"]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids) + 1)]


def test_sampled_token_outside_top_k_gets_k_plus_1_entries(plain_server, plain_form, emoji_ids):
    """At temperature 2 the alternatives are often sampled; logprobs stay the raw closed form."""
    for k in (0, 1):  # with K = 0 the sampled token is always the one extra entry
        choice = complete(plain_server, "[emoji]", AS_IDS, max_tokens=8, temperature=2.0, seed=11,
                          logprobs=k)
        got = completion_triples(choice["logprobs"])
        sampled = [t for t, _, _ in got]
        assert_entries(got, [completion_entry(plain_form, emoji_ids[j], s, k)
                             for j, s in enumerate(sampled)])
        off_script = [j for j, s in enumerate(sampled) if s != emoji_ids[j]]
        assert off_script and len(off_script) < len(sampled)  # on- and off-script draws
        assert {len(got[j][2]) for j in off_script} == {k + 1}


def test_minus_inf_is_shown_as_minus_9999(plain_server, plain_form, emoji_ids):
    """Past the named ids every logprob is -inf: it is shown as -9999.0, in both shapes."""
    n = 4
    choice = complete(plain_server, "[emoji]", AS_IDS, max_tokens=n, temperature=0, logprobs=5)
    chat = plain_server.client().chat.completions.create(
        model=None, messages=[{"role": "user", "content": "[emoji]"}], max_tokens=n, temperature=0,
        logprobs=True, top_logprobs=5, extra_body=AS_IDS).choices[0].model_dump()
    for got in (completion_triples(choice["logprobs"]), chat_triples(chat["logprobs"]["content"])):
        assert [t for t, _, _ in got] == emoji_ids[:n]
        for t, lp, top in got:
            finite = len(plain_form.named(t))  # 2 where t is an alternative itself, else 3
            assert_entries([(t, lp, top[:finite])], [plain_form.entry(t, finite)])
            assert [v for _, v in top[finite:]] == [-9999.0] * (5 - finite)


def test_allowed_token_ids_renormalise_and_drop_minus_inf(plain_server, plain_form, emoji_ids):
    """Logprobs over the allowed set: its -inf member is dropped, not clamped; fewer than K."""
    allowed = [bm.QWEN_IDS["</think>"], 271, 1000]  # 1000 has the base logit, -inf
    choice = complete(plain_server, "[emoji]", {**AS_IDS, "allowed_token_ids": allowed},
                      max_tokens=3, temperature=0, logprobs=5)
    want = []
    for t in emoji_ids[:3]:
        logits = sorted(((i, plain_form.logit(t, i)) for i in allowed), key=lambda x: -x[1])
        finite = [(i, a) for i, a in logits if a > -math.inf]
        norm = math.log(sum(math.exp(a) for _, a in finite))
        top = [(i, a - norm) for i, a in finite]
        want.append((top[0][0], top[0][1], top))
    assert_entries(completion_triples(choice["logprobs"]), want)
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])


@pytest.mark.parametrize("stop", [None, "eat"])
def test_completion_emoji_and_stop_cut(plain_server, plain_form, emoji_ids, stop):
    choice = complete(plain_server, "[emoji]", AS_IDS, max_tokens=40, temperature=0, logprobs=1,
                      stop=stop)
    if stop is None:
        assert choice["text"] == EMOJI_TEXT
        listed = [*emoji_ids, EOS]
    else:  # the token that completes the stop string is listed, nothing after it
        assert choice["text"] == EMOJI_TEXT[:EMOJI_TEXT.index(stop)]
        listed = emoji_ids[:emoji_ids.index(8831) + 1]  # " weather"
    assert_entries(completion_triples(choice["logprobs"]),
                   [completion_entry(plain_form, t, t, 1) for t in listed])


@pytest.mark.parametrize("stop", [None, "eat"])
def test_chat_emoji_and_stop_cut(plain_server, plain_form, emoji_ids, qwen35_tokenizer, stop):
    """No parser: every visible token has an entry; the four one-byte tokens of the emoji ride
    on the chunk that releases it, and a token cut by the stop string keeps its entry."""
    messages = [{"role": "user", "content": "[emoji]"}]
    native = {"max_tokens": 40, "temperature": 0, "logprobs": True, "top_logprobs": 2, "stop": stop}
    full = plain_server.client().chat.completions.create(model=None, messages=messages,
                                                         extra_body=AS_IDS, **native)
    view = chat_view(full.choices[0].model_dump())
    events = sse(plain_server, "/v1/chat/completions", {"messages": messages, **AS_IDS, **native})
    assert merge_chat_stream(events) == view

    content = EMOJI_TEXT if stop is None else EMOJI_TEXT[:EMOJI_TEXT.index(stop)]
    assert view["content"] == content
    listed = [emoji_ids[j] for j in positions(qwen35_tokenizer, emoji_ids, content)]
    assert_entries(chat_triples(view["logprobs"]), [plain_form.entry(t, 2) for t in listed])
    joined = b"".join(bytes(e["bytes"]) for e in view["logprobs"])
    assert joined == b"".join(token_bytes(qwen35_tokenizer, t) for t in listed)
    if stop is None:  # each chunk's entries spell exactly its own text
        assert joined == content.encode()
        for c in (c for ev in events for c in ev["choices"]):
            entries = (c["logprobs"] or {}).get("content") or []
            text = c["delta"].get("content") or ""
            assert b"".join(bytes(e["bytes"]) for e in entries) == text.encode()
    else:
        assert joined == b"Thinking.</think>\n\nHot \xf0\x9f\x99\x82 day. Nice weather"
