"""What a hostile or careless client sends, against a real server: a clean 4xx every time, and
the server keeps answering everyone else."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.servers import Server

pytestmark = pytest.mark.slow

KEY = "sk-test"
KV_TOKENS = 1024  # smaller than the tiny model's 8192-token context
MAX_PROMPTS = 8


@pytest.fixture(scope="module")
def own_server(tiny_qwen3_path):
    server = Server("--model", str(tiny_qwen3_path), "--api-key", KEY,
                    "--kv-cache-tokens", str(KV_TOKENS),
                    "--max-prompts-per-request", str(MAX_PROMPTS))
    yield server
    server.stop()


@pytest.fixture
def http(own_server):
    with httpx.Client(base_url=own_server.url, timeout=60,
                      headers={"authorization": f"bearer {KEY}"}) as client:
        yield client


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err


def _post(http, path: str, body: dict) -> httpx.Response:
    """POST `body` as ASCII JSON, so lone surrogates travel as the escapes a client sends."""
    return http.post(path, content=json.dumps(body).encode(),
                     headers={"content-type": "application/json"})


def _still_serving(http) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("seed", [2**64, 2**63, -1, -(2**63) - 1])
def test_out_of_range_seed_is_a_400_and_the_engine_lives(http, seed):
    body = {"prompt": "Hello", "max_tokens": 2, "seed": seed}
    _error(http.post("/v1/completions", json=body), 400, "seed")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "seed": seed}
    _error(http.post("/v1/chat/completions", json=chat), 400, "seed")
    _still_serving(http)


def test_seed_range_counts_the_n_choices(http):
    body = {"prompt": "Hello", "max_tokens": 2, "n": 2, "seed": 2**63 - 1}
    _error(http.post("/v1/completions", json=body), 400, "seed")
    body["seed"] = 2**63 - 2
    assert http.post("/v1/completions", json=body).status_code == 200


def test_underflowing_temperature_is_greedy(http):
    greedy = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    ref = http.post("/v1/completions", json=greedy).json()["choices"][0]
    for t in (1e-300, 1e-6):
        got = http.post("/v1/completions", json={**greedy, "temperature": t}).json()["choices"][0]
        assert got["text"] == ref["text"]
        assert got["logprobs"]["tokens"] == ref["logprobs"]["tokens"]


MESSAGES = [
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "user"}],
    [{"role": "user", "content": [{"type": "image_url"}]}],
    [{"role": "user", "content": "a\ud800b"}],
]


@pytest.mark.parametrize("messages", MESSAGES)
def test_tokenize_answers_messages_as_chat_does(http, messages):
    """Same status as chat for the same messages (this template renders a user turn without
    content; the default model's refuses it: tests/e2e/test_server.py), never a 5xx."""
    tok = _post(http, "/tokenize", {"messages": messages})
    chat = _post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert tok.status_code == chat.status_code, (tok.text, chat.text)
    if tok.status_code != 200:
        _error(tok, 400, "messages")


@pytest.mark.parametrize("body", [{"prompt": "a\ud800b"},
                                  {"prompt": "x", "messages": [{"role": "user", "content": "hi"}]},
                                  {}])
def test_tokenize_refuses_bad_prompts_with_400(http, body):
    _error(_post(http, "/tokenize", body), 400, "prompt")


def test_tokenize_joins_text_parts_as_chat_does(http):
    parts = http.post("/tokenize", json={"messages": MESSAGES[0]}).json()["tokens"]
    plain = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert parts == plain.json()["tokens"]


def test_detokenize_refuses_out_of_vocabulary_ids(http):
    _error(http.post("/detokenize", json={"tokens": [1, -5]}), 400, "tokens")
    ids = http.post("/tokenize", json={"prompt": "Hello there", "add_special_tokens": False})
    back = http.post("/detokenize", json={"tokens": ids.json()["tokens"]})
    assert back.json()["prompt"] == "Hello there"


def test_surrogate_model_name_is_an_escaped_404(http):
    r = http.post("/v1/completions", content=b'{"model": "\\ud800", "prompt": "x"}',
                  headers={"content-type": "application/json"})
    assert _error(r, 404, "model")["code"] == "model_not_found"


def test_huge_prompts_are_refused_before_tokenizing(http):
    big = "word " * 2_000_000  # 10 MB: its length alone rules it out
    t0 = time.monotonic()
    for path, body in [("/v1/completions", {"prompt": big, "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}),
                       ("/tokenize", {"prompt": big})]:
        err = _error(http.post(path, json=body), 400)
        assert err["code"] == "context_length_exceeded"
    elapsed = time.monotonic() - t0
    _still_serving(http)
    print(f"three 10 MB prompts refused in {elapsed:.2f} s")


def test_prompts_per_request_are_capped(http):
    body = {"prompt": ["Hi"] * (MAX_PROMPTS + 1), "max_tokens": 1}
    _error(http.post("/v1/completions", json=body), 400, "prompt")
    body = {"prompt": ["Hi"] * (MAX_PROMPTS // 2), "n": 3, "max_tokens": 1, "temperature": 1}
    _error(http.post("/v1/completions", json=body), 400, "prompt")
    body = {"prompt": ["Hi"] * MAX_PROMPTS, "max_tokens": 1}
    assert len(http.post("/v1/completions", json=body).json()["choices"]) == MAX_PROMPTS


def test_max_tokens_beyond_the_context_is_a_400_not_a_cap(http):
    ids = [9707] * 100
    err = _error(http.post("/v1/completions", json={"prompt": ids, "max_tokens": 8100}), 400)
    assert "maximum context length is 8192" in err["message"] and "8100 > 8192 - 100" in err["message"]


def test_chat_without_max_tokens_needs_no_kv_for_the_whole_context(scripted_model_path):
    """A pool of 256 tokens, a context of 8192: chats with no max_tokens run, 8 at once, each
    costing only the tokens it produces (the scripted reply is 15 tokens, then EOS)."""
    small = Server("--model", str(scripted_model_path), "--kv-cache-tokens", "256")
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        with httpx.Client(base_url=small.url, timeout=60) as client, ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda _: client.post("/v1/chat/completions", json=chat),
                                    range(8)))
        assert [r.status_code for r in replies] == [200] * 8, replies[0].text
        assert {r.json()["choices"][0]["message"]["content"] for r in replies} == {"Use a <b> tag."}
    finally:
        small.stop()


def test_a_non_streaming_client_that_leaves_is_aborted(own_server, http):
    def load() -> tuple[int, int]:  # held by the engine, and by the frontend (tokenizing, say)
        stats = http.get("/v1/stats").json()
        return stats["engine"].get("running", 0), stats["frontend_requests"]

    # Earlier tests on this server may still be ending theirs: count only what this one adds.
    before = load()
    body = {"prompt": "Write a long story.", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        http.post("/v1/completions", json=body, timeout=1.5)
    deadline = time.monotonic() + 30

    def held() -> bool:
        return any(now > then for now, then in zip(load(), before))

    while held():
        assert time.monotonic() < deadline, "the abandoned request is still running"
        time.sleep(0.2)
    _still_serving(http)
