"""`freetoken serve` on a tiny random Qwen3.5 (qwen3_5_text) with the qwen3 reasoning parser and
the qwen3_coder tool parser: chat logprobs under the parsers, and anyjev's Tacit scoring, each
checked against transformers on the same weights."""

from __future__ import annotations

import math

import httpx
import pytest

from tests.fixtures.build_models import QWEN_IDS
from tests.model_fixtures import reference_logprobs
from tests.support.scripted_logits import chat_triples
from tests.support.servers import Server

pytestmark = pytest.mark.slow

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
# Longer than the delta rule's chunk (64 tokens) once rendered.
QUESTION = "Describe the weather in Paris, Lyon and Marseille this week, city by city, briefly. " * 3


@pytest.fixture(scope="module")
def folder(tiny_hybrid_path):
    return tiny_hybrid_path("qwen3_5_text")


@pytest.fixture(scope="module")
def own_server(folder):
    server = Server(str(folder), "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder")
    yield server
    server.stop()


def _assert_matches_reference(folder, prompt_ids, entries):
    """Each entry (token, logprob, top alternatives) is transformers' log-softmax there."""
    output = [t for t, _, _ in entries]
    ref = reference_logprobs(folder, prompt_ids, output)
    for row, (token, logprob, top) in zip(ref, entries):
        assert abs(row[token].item() - logprob) <= 1e-4
        assert [i for i, _ in top] == row.topk(len(top)).indices.tolist()
        assert all(abs(row[i].item() - v) <= 1e-4 for i, v in top)


@pytest.mark.parametrize("thinking", [True, False], ids=["reasoning", "content"])
def test_chat_logprobs_under_the_parsers(own_server, folder, qwen35_tokenizer, thinking):
    """Thinking on: the output sits inside the think block the prompt opened, all reasoning;
    off: all content. Either way the entries are the model's, at the real marker ids."""
    messages = [{"role": "user", "content": QUESTION}]
    body = {"messages": messages, "tools": [TIME], "temperature": 0, "max_tokens": 8,
            "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True,
            "include_reasoning_logprobs": True, "chat_template_kwargs": {"enable_thinking": thinking}}
    r = httpx.post(f"{own_server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    prompt = qwen35_tokenizer.apply_chat_template(messages, tools=[TIME], add_generation_prompt=True,
                                                  enable_thinking=thinking, return_dict=False)
    assert len(prompt) > 64 and (prompt[-2] == QWEN_IDS["<think>"]) == thinking
    shown, hidden = ("reasoning_logprobs", "logprobs") if thinking else ("logprobs", "reasoning_logprobs")
    entries = chat_triples(choice[shown]["content"])
    assert len(entries) == 8 and not (choice.get(hidden) or {}).get("content")
    assert bool(choice["message"].get("reasoning_content")) == thinking
    _assert_matches_reference(folder, prompt, entries)
    stats = httpx.get(f"{own_server.url}/v1/stats", timeout=10).json()["engine"]
    assert stats["state_snapshots"] >= 1 and stats["state_bytes_per_slot"] > 0


def test_tacit_one_forward_and_adaptive(own_server, folder):
    from anyjev import Tacit
    from anyjev.readout import build_prompt, render_chat

    model = httpx.get(f"{own_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    items = [dict(state="The sky is blue. " * 12, question="What colour is the sky?",
                  options=["blue", "green"]),
             dict(state="Fire is hot. " * 12, question="Is fire hot?", kind="yes_no")]
    tacit = Tacit.from_pretrained(str(folder), engine="server", base_url=own_server.url, served_model=model)
    out = tacit.decide_batch(items)
    # One forward: the labels' logprobs among the top 20, renormalised over the labels.
    for item, d in zip(items, out):
        norm = tacit._normalise(item)
        text = render_chat(tacit.tok, build_prompt(norm["state"], norm["q"], list(range(norm["q"].k)),
                                                   tacit.system, norm["labels"]))
        row = reference_logprobs(folder, tacit.tok(text, add_special_tokens=False).input_ids, [])[0]
        top = set(row.topk(20).indices.tolist())
        values = [row[t].item() if t in top else -math.inf for t in norm["ids"]]
        if all(v == -math.inf for v in values):
            values = [0.0] * len(values)
        m = max(values)
        probs = [math.exp(v - m) for v in values]
        assert [p / sum(probs) for p in probs] == pytest.approx(list(d["probs"].values()), abs=1e-4)
        assert d["route"] == "one_forward"
    # Every decision wants a reasoning pass (tau), half may have one. Greedy: anyjev counts
    # reasoning tokens by re-tokenizing the text, and the random model's sampled text (its
    # default temperature 0.6) re-tokenized into 18 tokens once.
    adaptive = Tacit(tacit.engine, tacit.tok, adaptive=True, tau=1e9, max_cot_share=0.5,
                     cot_window=None, cot_max_tokens=16, temperature=0.0)
    routes = adaptive.decide_batch(items)
    assert sorted(d["route"] for d in routes) == ["cot", "one_forward"]
    for d in routes:
        assert abs(sum(d["probs"].values()) - 1) < 1e-6
        if d["route"] == "cot":
            assert 0 < d["reasoning_tokens"] <= 17


def test_a_seeded_request_sent_twice_gives_the_same_answer(own_server):
    """The request that gave two different answers when the hybrids were not batch-invariant
    (its two choices, and the second send's prefix-cache hit, each run in another company)."""
    body = {"prompt": QUESTION, "n": 2, "temperature": 1, "seed": 7, "max_tokens": 24,
            "logprobs": 2}
    first, second = (httpx.post(f"{own_server.url}/v1/completions", json=body, timeout=120) for _ in range(2))
    assert first.status_code == 200, first.text

    def answers(reply: httpx.Response) -> list:
        return [(c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"])
                for c in reply.json()["choices"]]

    assert answers(first) == answers(second)
