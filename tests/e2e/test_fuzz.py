"""Generated request bodies against a real server (real engine behind it): never a 5xx, streams
well formed, and the server still answers a normal request afterwards.

First every boundary value of every field, one at a time, on a valid request (~700 bodies);
then hypothesis bodies that start from a valid request and have a few fields replaced by
boundary values, garbage or unknown names (600), so most of them get past the schema and reach
validation, tokenization and the engine. `derandomize` keeps CI reproducible; run with `--hypothesis-seed=N` (and without
derandomize) to explore further.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.servers import Server

pytestmark = pytest.mark.slow

EXAMPLES = 300  # per endpoint: 600 bodies in all

# Boundary values, swept field by field below, and drawn from evenly by hypothesis (which draws
# integers() and floats() mostly small and simple).
BOUNDARY = {
    "int": [-3, -1, 0, 1, 2, 3, 5, 16, 20, 21, 64, 2**31 - 1, 2**31, 2**63 - 2, 2**63 - 1,
            2**63, 2**64, -(2**63) - 1, 248_319, 248_320, 10**30],
    "float": [0.0, -0.0, 1e-300, 1e-6, 1e-5, 0.5, 1.0, 2.0, 2.0001, -1.0, 1e308, math.inf,
              -math.inf, math.nan],
    "str": ["", "a", "Hello", "\ud800", "</think>", "<|im_end|>", "<tool_call>", "x" * 3000, "{}",
            "text", "json_object"],
    "bool": [True, False, 0, "true", None],
    "ids": [[], [0], [-1], [248_319], [248_320], [2**63], [1, 2**31], list(range(100, 120))],
}
INTS, FLOATS, BOOLS = (st.sampled_from(BOUNDARY[k]) for k in ("int", "float", "bool"))
STRS = st.sampled_from(BOUNDARY["str"]) | st.text(max_size=12)
IDS = st.sampled_from(BOUNDARY["ids"]) | st.lists(INTS | st.integers(0, 248_330), max_size=6)
SCALAR = st.none() | st.booleans() | INTS | FLOATS | STRS
GARBAGE = st.recursive(SCALAR | IDS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(STRS, inner, max_size=3), max_leaves=6)
OF_KIND = {"int": INTS, "float": FLOATS, "str": STRS, "bool": BOOLS, "ids": IDS}

COMMON_KINDS = {
    "max_tokens": "int", "max_completion_tokens": "int", "temperature": "float", "top_p": "float",
    "top_k": "int", "min_p": "float", "seed": "int", "n": "int", "stop": "str",
    "stop_token_ids": "ids", "ignore_eos": "bool", "stream": "bool", "allowed_token_ids": "ids",
    "return_tokens_as_token_ids": "bool", "presence_penalty": "float", "best_of": "int",
    "user": "str", "frequency_penalty": "float", "repetition_penalty": "float", "min_tokens": "int",
    "prompt_logprobs": "int", "include_stop_str_in_output": "bool", "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool", "add_special_tokens": "bool",
}
COMPLETION_KINDS = {**COMMON_KINDS, "prompt": "str", "logprobs": "int", "echo": "bool",
                    "suffix": "str"}
CHAT_KINDS = {**COMMON_KINDS, "logprobs": "bool", "top_logprobs": "int",
              "include_reasoning_logprobs": "bool"}

COMMON = {
    "model": st.sampled_from(["tiny", "other", ""]),
    "stop": STRS | st.lists(STRS, max_size=3),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logit_bias": st.dictionaries(STRS | st.integers(-2, 50_000).map(str), FLOATS, max_size=2),
    "bad_words": st.lists(STRS, max_size=3),
    "response_format": st.fixed_dictionaries({"type": STRS}) | st.fixed_dictionaries(
        {"type": st.sampled_from(["json_object", "json_schema", "text"])},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"name": STRS,
                                                                     "schema": GARBAGE})}),
    "guided_json": GARBAGE | st.sampled_from([{"type": "object"}, {"type": "integer"}]),
    "guided_regex": STRS | st.sampled_from(["[a-z]{1,3}", "a("]),
    "guided_choice": st.lists(STRS, max_size=3),
    "guided_grammar": STRS | st.sampled_from(['root ::= "a" | "b"', "start: x"]),
    "guided_decoding_backend": STRS | st.sampled_from(["xgrammar", "guidance"]),
    "guided_whitespace_pattern": STRS,
    "structured_outputs": st.dictionaries(st.sampled_from(
        ["json", "regex", "choice", "grammar", "json_object", "whitespace_pattern"]),
        GARBAGE, max_size=2),
    "made_up_field": GARBAGE,
}
COMPLETION = {**{k: OF_KIND[v] for k, v in COMPLETION_KINDS.items()}, **COMMON,
              "prompt": STRS | IDS | st.lists(IDS, max_size=3) | st.lists(STRS, max_size=3)}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "robot"])},
    optional={"content": STRS | st.none() | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"])}, optional={"text": STRS}), max_size=2),
        "tool_calls": GARBAGE, "name": STRS})
CHAT = {**{k: OF_KIND[v] for k, v in CHAT_KINDS.items()}, **COMMON,
        "messages": st.lists(MESSAGE, max_size=3), "tools": GARBAGE, "tool_choice": STRS | GARBAGE,
        "chat_template_kwargs": st.dictionaries(STRS, SCALAR, max_size=2)}
COMPLETION_BASE = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
CHAT_BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def bodies(base: dict, fields: dict) -> st.SearchStrategy[dict]:
    """`base` with 2-6 fields set from their strategy (or from garbage), or deleted."""
    names = sorted(fields)
    changes = st.sets(st.sampled_from(names), min_size=2, max_size=6)

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
def own_server(tiny_qwen3_path):
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
def client(own_server):
    with httpx.Client(base_url=own_server.url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("path,base,kinds", [
    ("/v1/completions", COMPLETION_BASE, COMPLETION_KINDS),
    ("/v1/chat/completions", CHAT_BASE, CHAT_KINDS),
], ids=["completions", "chat"])
def test_every_boundary_value_of_every_field_is_answered_below_500(client, path, base, kinds):
    for name, kind in kinds.items():
        for value in BOUNDARY[kind]:
            _check(client, path, {**base, name: value})


@SETTINGS
@given(body=bodies(COMPLETION_BASE, COMPLETION))
def test_fuzzed_completions_never_5xx(client, body):
    _check(client, "/v1/completions", body)


@SETTINGS
@given(body=bodies(CHAT_BASE, CHAT))
def test_fuzzed_chat_never_5xx(client, body):
    _check(client, "/v1/chat/completions", body)


def test_server_answers_normally_after_the_fuzzing(client):
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert client.get("/health").status_code == 200
