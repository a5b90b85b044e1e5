"""Generated request bodies against a real server (real engine behind it): never a 5xx, streams
well formed, and the server still answers a normal request afterwards.

Bodies start from a valid request and have a few fields replaced by boundary values, garbage
or unknown names, so most of them get past the schema and reach validation, tokenization and
the engine. `derandomize` keeps CI reproducible; run with `--hypothesis-seed=N` (and without
derandomize) to explore further.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.support import Server

pytestmark = pytest.mark.slow

EXAMPLES = 300  # per endpoint: 600 bodies in all

INTS = st.sampled_from([0, 1, -1, 2, 16, 20, 21, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64,
                        -(2**63) - 1, 248_319, 248_320]) | st.integers(-3, 40)
FLOATS = st.sampled_from([0.0, -0.0, 1e-300, 1e-6, 1e-5, 0.5, 1.0, 2.0, 2.0001, -1.0, 1e308,
                          math.inf, -math.inf, math.nan])
STRS = st.sampled_from(["", "a", "Hello", "\ud800", "</think>", "<|im_end|>", "<tool_call>",
                        "x" * 3000, "{}", "text", "json_object"]) | st.text(max_size=12)
IDS = st.lists(st.integers(-2, 248_330) | INTS, max_size=6)
SCALAR = st.none() | st.booleans() | INTS | FLOATS | STRS
GARBAGE = st.recursive(SCALAR | IDS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(STRS, inner, max_size=3), max_leaves=6)

COMMON = {
    "model": st.sampled_from(["tiny", "other", ""]),
    "max_tokens": INTS, "max_completion_tokens": INTS, "temperature": FLOATS, "top_p": FLOATS,
    "top_k": INTS, "min_p": FLOATS, "seed": INTS, "n": INTS,
    "stop": STRS | st.lists(STRS, max_size=3), "stop_token_ids": IDS, "ignore_eos": st.booleans(),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "allowed_token_ids": IDS, "return_tokens_as_token_ids": st.booleans(),
    "presence_penalty": FLOATS, "logit_bias": st.dictionaries(STRS, FLOATS, max_size=2),
    "response_format": st.fixed_dictionaries({"type": STRS}), "best_of": INTS, "user": STRS,
    "made_up_field": GARBAGE,
}
COMPLETION = {**COMMON, "prompt": STRS | IDS | st.lists(IDS, max_size=3) | st.lists(STRS, max_size=3),
              "logprobs": INTS, "echo": st.booleans(), "suffix": STRS}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "robot"])},
    optional={"content": STRS | st.none() | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"])}, optional={"text": STRS}), max_size=2),
        "tool_calls": GARBAGE, "name": STRS})
CHAT = {**COMMON, "messages": st.lists(MESSAGE, max_size=3), "logprobs": st.booleans(),
        "top_logprobs": INTS, "tools": GARBAGE, "tool_choice": STRS | GARBAGE,
        "chat_template_kwargs": st.dictionaries(STRS, SCALAR, max_size=2),
        "include_reasoning_logprobs": st.booleans()}


def bodies(base: dict, fields: dict) -> st.SearchStrategy[dict]:
    """`base` with 1-4 fields set from their strategy (or from garbage), or deleted."""
    names = sorted(fields)
    changes = st.dictionaries(st.sampled_from(names), st.none(), min_size=1, max_size=4)

    @st.composite
    def build(draw):
        body = dict(base)
        for name in draw(changes):
            choice = draw(st.integers(0, 9))
            if choice == 0:
                body.pop(name, None)
            else:
                body[name] = draw(GARBAGE if choice == 1 else fields[name])
        return body

    return build()


@pytest.fixture(scope="module")
def server(tiny_qwen3_path):
    # Short outputs keep 600 requests inside the CI budget; larger max_tokens are 400s.
    server = Server("--model", str(tiny_qwen3_path), "--served-model-name", "tiny",
                    "--max-output-tokens", "6")
    yield server
    server.stop()


def _check(client: httpx.Client, path: str, body: dict) -> None:
    raw = json.dumps(body).encode()  # NaN and inf travel as JSON's common extensions
    with client.stream("POST", path, content=raw,
                       headers={"content-type": "application/json"}) as r:
        text = r.read().decode()
    assert r.status_code < 500, (path, body, r.status_code, text[:500])
    if r.status_code != 200:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"}, text
    elif r.headers["content-type"].startswith("text/event-stream"):
        frames = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert frames and frames[-1] == "[DONE]", text[-500:]
        for frame in frames[:-1]:
            event = json.loads(frame)
            assert "error" not in event or event["error"]["code"] not in ("engine_dead", "engine_error")
    else:
        json.loads(text)


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@SETTINGS
@given(body=bodies({"model": "tiny", "prompt": "Hello", "max_tokens": 2}, COMPLETION))
def test_fuzzed_completions_never_5xx(client, body):
    _check(client, "/v1/completions", body)


@SETTINGS
@given(body=bodies({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2}, CHAT))
def test_fuzzed_chat_never_5xx(client, body):
    _check(client, "/v1/chat/completions", body)


def test_server_answers_normally_after_the_fuzzing(client):
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert client.get("/health").status_code == 200
