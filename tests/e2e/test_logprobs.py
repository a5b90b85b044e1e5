"""Logprobs through the real server, against HF transformers' log-softmax on the same weights."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.model_fixtures import default_folder, reference_logprobs
from tests.support.sse import assert_completion_stream_joins

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(server):
    """The default model, no flags."""
    return server()


MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(default_folder())


def _post(server, path, body):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, path, body) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def _completion_ids(tok, lp) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "seed": 3}])
def test_completion_logprobs_match_hf(default_server, tok, sampling):
    prompt = "The three primary colours are"
    body = {"prompt": prompt, "max_tokens": 10, "logprobs": 5, "return_tokens_as_token_ids": True,
            "ignore_eos": True, **sampling}
    lp = _post(default_server, "/v1/completions", body)["choices"][0]["logprobs"]
    ids = _completion_ids(tok, lp)
    ref = reference_logprobs(default_folder(), tok.encode(prompt), ids)
    for i, token in enumerate(ids):
        assert abs(lp["token_logprobs"][i] - ref[i, token].item()) <= 1e-4
        top = lp["top_logprobs"][i]
        assert 5 <= len(top) <= 6 and next(iter(top)) == f"token_id:{token}"
        for key, value in top.items():
            assert abs(value - ref[i, int(key.removeprefix("token_id:"))].item()) <= 1e-4
        ranked = ref[i].topk(5).indices.tolist()
        assert {f"token_id:{t}" for t in ranked} <= set(top)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "seed": 5}])
def test_chat_logprobs_match_hf(default_server, tok, sampling):
    messages = [{"role": "user", "content": "Name a fruit."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "logprobs": True,
            "top_logprobs": 3, "return_tokens_as_token_ids": True, **sampling}
    out = _post(default_server, "/v1/chat/completions", body)["choices"][0]
    entries = out["logprobs"]["content"]
    ids = [int(e["token"].removeprefix("token_id:")) for e in entries]
    prompt_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
    ref = reference_logprobs(default_folder(), prompt_ids, ids)
    for i, (token, e) in enumerate(zip(ids, entries)):
        assert abs(e["logprob"] - ref[i, token].item()) <= 1e-4
        assert [int(t["token"].removeprefix("token_id:")) for t in e["top_logprobs"]] == \
            ref[i].topk(3).indices.tolist()
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == out["message"]["content"]


def test_completion_stream_entries_join_to_non_stream(default_server):
    body = {"prompt": "Write the word café twice:", "max_tokens": 16, "temperature": 0, "logprobs": 2}
    full = _post(default_server, "/v1/completions", body)["choices"][0]
    events = _stream(default_server, "/v1/completions", body)
    assert_completion_stream_joins(events, full)


def test_chat_stream_entries_join_to_non_stream_with_stop_cut(default_server):
    messages = [{"role": "user", "content": "Say: hello world, how are you?"}]
    base = {"model": MODEL, "messages": messages, "max_tokens": 20, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    free = _post(default_server, "/v1/chat/completions", base)["choices"][0]["message"]["content"]
    body = {**base, "stop": [free[5:8]]}  # cuts inside the text, often mid-token
    full = _post(default_server, "/v1/chat/completions", body)["choices"][0]
    events = _stream(default_server, "/v1/chat/completions", body)
    streamed = [e for ev in events for c in ev["choices"] if c.get("logprobs")
                for e in c["logprobs"]["content"]]
    assert streamed == full["logprobs"]["content"]
    visible = full["message"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in streamed).decode(errors="replace")
    assert joined.startswith(visible) and len(joined) < len(visible) + 8


CHAT_ERRORS = [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": "x"}, "top_logprobs"),
]


@pytest.mark.parametrize("override,param", CHAT_ERRORS)
def test_chat_logprob_errors(default_server, override, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **override}
    r = httpx.post(f"{default_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_chat_logprobs_need_single_id_markers():
    """The default model has no single-id <think>: logprobs under qwen3 parsing is a 400."""
    from tests.support.servers import Server

    server = Server("--reasoning-parser", "qwen3")
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "logprobs" and "<think>" in err["message"]
        body.pop("logprobs")
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    finally:
        server.stop()
