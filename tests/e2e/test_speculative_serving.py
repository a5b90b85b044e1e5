"""`freetoken serve --speculative-config` (prompt lookup) against the same server without it:
the same requests give the same bytes of text and the same logprobs, streamed and not, greedy
and seeded; /metrics counts the drafts."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.support.servers import ROOT

pytestmark = pytest.mark.slow

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
PASSAGE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
           "    return total / len(values)\n")
MESSAGES = [{"role": "user", "content": f"Copy this code exactly:\n{PASSAGE}"}]


@pytest.fixture(scope="module")
def servers(server):
    return server(), server("--speculative-config", SPEC)


def _chat(server, stream: bool) -> tuple[str, list, str]:
    client = server.client()
    fields = dict(model=client.models.list().data[0].id, messages=MESSAGES, temperature=0, max_tokens=60,
                  logprobs=True, top_logprobs=3, stop=["len("])
    if not stream:
        choice = client.chat.completions.create(**fields).choices[0]
        return choice.message.content, [e.model_dump() for e in choice.logprobs.content], \
            choice.finish_reason
    text, entries, finish = "", [], None
    for chunk in client.chat.completions.create(**fields, stream=True):
        if chunk.choices:
            choice = chunk.choices[0]
            text += choice.delta.content or ""
            entries += [e.model_dump() for e in (choice.logprobs.content if choice.logprobs else [])]
            finish = choice.finish_reason or finish
    return text, entries, finish


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_plain_decoding(servers, stream):
    plain, drafted = (_chat(s, stream) for s in servers)
    assert drafted == plain
    # The stop string cut the answer: the tokens drafted past it were dropped in both.
    assert plain[2] == "stop" and plain[0].startswith("```python\ndef mean(values):")


def test_seeded_completions_equal_plain_decoding(servers):
    body = {"prompt": PASSAGE + PASSAGE[:30], "max_tokens": 40, "temperature": 0.7, "seed": 5,
            "n": 2, "logprobs": 2, "presence_penalty": 0.2, "ignore_eos": True}
    plain, drafted = (httpx.post(f"{s.url}/v1/completions", json=body, timeout=120).json()
                      for s in servers)
    for a, b in zip(plain["choices"], drafted["choices"]):
        assert (b["text"], b["logprobs"]) == (a["text"], a["logprobs"])


def test_metrics_count_drafts_and_a_request_may_opt_out(servers):
    _, drafted = servers

    def counted() -> dict[str, float]:
        text = httpx.get(f"{drafted.url}/metrics", timeout=10).text
        lines = [x for x in text.splitlines() if x.startswith("freetoken:spec_decode_num_")]
        assert lines and all('method="ngram"' in x for x in lines)
        return {x.split("{")[0]: float(x.rsplit(" ", 1)[1]) for x in lines}

    documented = set(re.findall(r"`(freetoken:spec_decode_[a-z_]+)`", (ROOT / "docs/server.md").read_text()))
    assert set(counted()) == documented

    # Repeated text: its last tokens occurred before, so every decode step has a draft to offer.
    body = {"prompt": PASSAGE * 3, "max_tokens": 24, "temperature": 0}
    before = counted()
    assert before["freetoken:spec_decode_num_accepted_tokens_total"] > 0  # by the tests above
    out = httpx.post(f"{drafted.url}/v1/completions", json={**body, "speculative": False},
                     timeout=120).json()
    assert counted() == before
    # Whether a step drafts is measured (speculation.ModeChoice): where plain steps ran faster on
    # this machine, a one-request bucket stays plain for up to 16 epochs of 4 steps before it
    # tries drafts again, longer than one request's 23 decode steps; five requests outlast that.
    drafts = "freetoken:spec_decode_num_draft_tokens_total"
    for _ in range(5):
        again = httpx.post(f"{drafted.url}/v1/completions", json=body, timeout=120).json()
        after = counted()
        if after[drafts] > before[drafts]:
            break
    assert after[drafts] > before[drafts]
    # A verifying step emits its accepted tokens and the one sampled after them, unless the
    # request finishes among them.
    emitted, accepted, steps = (after[f"freetoken:spec_decode_num_{k}_total"]
                                for k in ("emitted_tokens", "accepted_tokens", "drafts"))
    assert accepted < emitted <= accepted + steps
    assert again["choices"][0]["text"] == out["choices"][0]["text"]
