"""`freetoken serve` on the default model, driven by the openai client and raw httpx."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(server):
    """The default model, no flags."""
    return server()


PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Water boils at"]


def _complete(server, prompt, **kw):
    kw = {"max_tokens": 12, "temperature": 0, **kw}
    return server.client().completions.create(model=None, prompt=prompt, **kw)


def _sse_events(response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def test_models_lists_the_served_model(default_server):
    body = httpx.get(f"{default_server.url}/v1/models").json()
    [card] = body["data"]
    assert card["id"] == "SmolLM2-135M-Instruct.Q4_1" and card["max_model_len"] == 8192


def test_completion_stream_equals_non_stream(default_server):
    full = _complete(default_server, PROMPTS[0], max_tokens=20)
    chunks = list(_complete(default_server, PROMPTS[0], max_tokens=20, stream=True,
                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and len(text) > 0
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20


def test_chat_stream_equals_non_stream(default_server):
    client = default_server.client()
    msgs = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=msgs,
                                          max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=msgs,
                                            max_tokens=24, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content and text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_prompt_batch_is_in_order_and_equals_single(default_server):
    batch = _complete(default_server, PROMPTS)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for prompt, choice in zip(PROMPTS, batch.choices):
        assert choice.text == _complete(default_server, prompt).choices[0].text
    assert batch.usage.completion_tokens == 4 * 12


def test_n_with_seed_is_reproducible_and_distinct(default_server):
    kw = dict(n=2, temperature=1.0, seed=7, max_tokens=16)
    a = _complete(default_server, PROMPTS[1], **kw)
    b = _complete(default_server, PROMPTS[1], **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text


def test_stop_string_cuts_exactly(default_server):
    free = _complete(default_server, PROMPTS[0], max_tokens=20).choices[0].text
    stop = free[8:11]  # a string that ends mid-text, likely across token boundaries
    cut = _complete(default_server, PROMPTS[0], max_tokens=20, stop=[stop])
    assert cut.choices[0].text == free[: free.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = _complete(default_server, PROMPTS[0], max_tokens=20, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_sixteen_concurrent_requests_match_sequential(default_server):
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]
    sequential = [_complete(default_server, p).choices[0].text for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(lambda p: _complete(default_server, p).choices[0].text, prompts))
    assert concurrent == sequential


def test_disconnect_mid_stream_aborts_the_request(default_server):
    body = {"prompt": PROMPTS[1], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{default_server.url}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    deadline = time.time() + 30
    while time.time() < deadline:
        stats = httpx.get(f"{default_server.url}/v1/stats").json()
        if stats["engine"].get("running") == 0 and stats["frontend_requests"] == 0:
            break
        time.sleep(0.2)
    assert stats["engine"]["running"] == 0 and stats["engine"]["waiting"] == 0
    assert stats["frontend_requests"] == 0
    assert _complete(default_server, PROMPTS[0]).choices[0].text


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "hello " * 9000}, 400, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2,
      "temperature": 0}, 400, "n"),  # greedy n > 1, as vLLM
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_input_gets_openai_error(default_server, path, body, status, param):
    r = httpx.post(f"{default_server.url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if "hello" in str(body):
        assert err["code"] == "context_length_exceeded"
    assert _complete(default_server, PROMPTS[0], max_tokens=2).choices[0].text


def test_non_json_body_is_a_400(default_server):
    r = httpx.post(f"{default_server.url}/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_tokenize_and_detokenize_round_trip(default_server):
    ids = httpx.post(f"{default_server.url}/tokenize", json={"prompt": " Yes"}).json()["tokens"]
    text = httpx.post(f"{default_server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == " Yes"


@pytest.mark.parametrize("messages", [[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                      [{"role": "user"}]])
def test_tokenize_takes_messages_as_chat_does_on_the_default_template(default_server, messages):
    """SmolLM2's template: text parts are joined (200, as chat); a turn without content cannot
    render (400 naming messages, as chat) — neither is a 500."""
    tok = httpx.post(f"{default_server.url}/tokenize", json={"messages": messages})
    chat = httpx.post(f"{default_server.url}/v1/chat/completions",
                      json={"messages": messages, "max_tokens": 1}, timeout=60)
    assert tok.status_code == chat.status_code
    if "content" in messages[0]:
        assert tok.status_code == 200 and tok.json()["count"] > 0
    else:
        assert tok.status_code == 400 and tok.json()["error"]["param"] == "messages"


def test_assistant_tool_call_turn_with_null_content_renders(default_server):
    """The turn the openai SDK and LangChain send back after a tool call (content null beside
    tool_calls), then the tool's result: SmolLM2's template reads `message.content` of every turn."""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    reply = default_server.client().chat.completions.create(
        model=None, messages=messages, max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    tok = httpx.post(f"{default_server.url}/tokenize", json={"messages": messages})
    assert tok.status_code == 200 and tok.json()["count"] == reply.usage.prompt_tokens
