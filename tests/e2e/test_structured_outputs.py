"""Structured outputs through `freetoken serve`: response_format, structured_outputs and guided_*
on the default model, tool_choice "required" and named on the tiny Qwen3 with the hermes and
qwen3_coder parsers, the grammar after the reasoning, and a fuzz of schemas.

Requests that can run together are sent together: the engine batches them.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.chat import NO_THINKING
from tests.support.servers import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(server):
    """The default model, no flags."""
    return server()


@pytest.fixture(scope="module")
def hermes_server(server, tiny_qwen3_path):
    """The tiny Qwen3 (real weights, no script) with qwen3 reasoning and hermes tool calls."""
    return server("--model", str(tiny_qwen3_path), "--tool-call-parser", "hermes",
                  "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def coder_server(server, tiny_qwen3_path):
    """The tiny Qwen3 with qwen3_coder tool calls and no reasoning parser."""
    return server("--model", str(tiny_qwen3_path), "--tool-call-parser", "qwen3_coder",
                  "--reasoning-parser", "off")


@pytest.fixture(scope="module")
def harmony_server(server, harmony_scripted_path):
    """The Harmony scripted model; auto picks the gpt_oss reasoning and tool parsers."""
    return server("--model", str(harmony_scripted_path))


TIMEOUT = 600  # the first structured request of a server builds llguidance's tokenizer
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "shade": {"type": "string", "enum": ["light", "dark"]}},
        "required": ["color", "shade"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
            "required": ["id", "email"], "additionalProperties": False},
        "active": {"type": "boolean"}},
        "required": ["user", "active"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                 "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "count": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["score", "count"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                            {"type": "string", "enum": ["none", "many"]}]}},
        "required": ["value"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"], "additionalProperties": False},
    "orders": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "pattern": "^[0-9]{4}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "const_null": {"type": "object", "properties": {
        "kind": {"const": "report"}, "ok": {"type": "boolean"},
        "note": {"type": ["string", "null"], "maxLength": 15}},
        "required": ["kind", "ok", "note"], "additionalProperties": False},
    "refs": {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False},
}


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=TIMEOUT)


def ok(server: Server, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server: Server, path: str, body: dict) -> list[dict]:
    """The streamed choices' deltas joined: chat content, reasoning and calls; completion text."""
    out: dict[int, dict] = {}
    with httpx.stream("POST", f"{server.url}/v1/{path}", json={**body, "stream": True},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                got = out.setdefault(c["index"], {"content": "", "reasoning": "", "calls": {}})
                delta = c.get("delta", {"content": c.get("text", "")})
                got["content"] += delta.get("content") or ""
                got["reasoning"] += delta.get("reasoning_content") or ""
                for call in delta.get("tool_calls") or []:
                    slot = got["calls"].setdefault(call["index"], ["", ""])
                    slot[0] += call["function"].get("name") or ""
                    slot[1] += call["function"].get("arguments") or ""
    return [out[i] for i in sorted(out)]


def joined(choice: dict) -> dict:
    """A non-streamed chat choice in `streamed`'s shape."""
    m = choice["message"]
    calls = {i: [c["function"]["name"], c["function"]["arguments"]]
             for i, c in enumerate(m.get("tool_calls") or [])}
    return {"content": m["content"] or "", "reasoning": m.get("reasoning_content") or "",
            "calls": calls}


def schema_body(name: str, temperature: float, **extra) -> dict:
    schema = SCHEMAS[name]
    return {"messages": [
        {"role": "system", "content": "You reply with JSON only."},
        {"role": "user", "content": f"Give an example that follows this JSON schema: "
                                    f"{json.dumps(schema)}"}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": name, "schema": schema, "strict": True}},
        "temperature": temperature, "seed": 11, "max_tokens": 80, **extra}


@pytest.fixture(scope="module")
def schema_answers(default_server) -> dict:
    cases = [(name, t) for name in SCHEMAS for t in (0, 1)]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = pool.map(lambda c: ok(default_server, "chat/completions", schema_body(*c)),
                           cases)
        return {c: a["choices"][0] for c, a in zip(cases, answers)}


@pytest.mark.parametrize("temperature", [0, 1])
@pytest.mark.parametrize("name", SCHEMAS)
def test_every_answer_parses_and_validates(schema_answers, name, temperature):
    choice = schema_answers[name, temperature]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])


def test_streamed_answer_is_the_non_streamed_one(default_server):
    body = schema_body("nested", 1)
    whole = ok(default_server, "chat/completions", body)["choices"][0]
    assert streamed(default_server, "chat/completions", body) == [joined(whole)]


def test_json_object_answers_are_objects(default_server):
    body = {"messages": [{"role": "user", "content": 'Reply with a JSON object with one key '
                                                     '"answer": the capital of France.'}],
            "response_format": {"type": "json_object"}, "max_tokens": 60}
    bodies = [{**body, "temperature": 0}, {**body, "temperature": 1, "seed": 1, "n": 3}]
    with ThreadPoolExecutor(2) as pool:
        greedy, sampled = pool.map(lambda b: ok(default_server, "chat/completions", b), bodies)
    assert greedy["choices"][0]["finish_reason"] == "stop"
    for choice in greedy["choices"] + sampled["choices"]:
        text = choice["message"]["content"]
        assert text.startswith("{")
        if choice["finish_reason"] == "stop":  # sampled, a small model may ramble on
            assert isinstance(json.loads(text), dict)


COMPLETIONS = [  # (fields, check of the text)
    ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda t: t in ("red", "blue")),
    ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"structured_outputs": {"regex": "(ab|cd){2,3}"}}, lambda t: re.fullmatch("(ab|cd){2,3}", t)),
    ({"guided_grammar": 'root ::= ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!")),
    ({"guided_grammar": 'start: ("up" | "down") " " /[0-9]/'},
     lambda t: re.fullmatch("(up|down) [0-9]", t)),
    ({"guided_json": SCHEMAS["enums"]},
     lambda t: jsonschema.validate(json.loads(t), SCHEMAS["enums"]) is None),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": SCHEMAS["pattern"]}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMAS["pattern"]) is None),
    ({"guided_json": SCHEMAS["enums"], "guided_whitespace_pattern": "",
      "guided_decoding_backend": "xgrammar"}, lambda t: " " not in t and json.loads(t)),
]


@pytest.mark.parametrize("temperature", [0, 1])
def test_completions_follow_choice_regex_grammar_and_json(default_server, temperature):
    bodies = [{"prompt": "Answer:", "max_tokens": 40, "temperature": temperature, "seed": 5,
               **fields} for fields, _ in COMPLETIONS]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: ok(default_server, "completions", b), bodies))
    for (fields, check), answer in zip(COMPLETIONS, answers):
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), (fields, choice)


def test_streamed_completion_is_the_non_streamed_one(default_server):
    body = {"prompt": "Call me at", "max_tokens": 20, "temperature": 1, "seed": 2,
            "guided_regex": r"[0-9]{3}-[0-9]{4}"}
    text = ok(default_server, "completions", body)["choices"][0]["text"]
    assert [c["content"] for c in streamed(default_server, "completions", body)] == [text]


REFUSED = [
    ({"guided_json": {"type": "foo"}}, "guided_json"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "integer", "minimum": 3, "maximum": 1}}}}, "response_format"),
]


@pytest.mark.parametrize("fields,param", REFUSED)
def test_bad_structured_requests_are_400s_naming_the_field(default_server, fields, param):
    r = post(default_server, "chat/completions",
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_required_tool_choice_without_a_tool_parser_is_a_forced_call(default_server):
    """The default model runs without a tool parser: the call is forced all the same."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
            "parallel_tool_calls": False}
    choice = ok(default_server, "chat/completions", body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "f", "arguments": "{}"}]


# Tool calls on the tiny random Qwen3: any token the grammar allows may come, so the tools'
# values are bounded (enums, ranges, booleans, short strings) and every sample ends.
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "New York"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"},
    "note": {"type": "string", "maxLength": 12}},
    "required": ["city", "days"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {
    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
    "label": {"type": "string", "enum": ["wake", "nap"]},
    "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2}},
    "required": ["hour"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}}]
PARAMS = {"get_weather": WEATHER, "set_alarm": ALARM}
THINK_END = 248069  # </think> in the Qwen3.5 vocabulary


def tool_body(tool_choice, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "Weather in Paris, and wake me at 7?"}],
            "tools": TOOLS, "tool_choice": tool_choice, "temperature": 1, "seed": 21,
            "max_tokens": 150, **NO_THINKING, **extra}


def assert_valid_calls(choice: dict, names: set[str], most: int | None = None) -> list[dict]:
    calls = choice["message"].get("tool_calls") or []
    assert choice["finish_reason"] == "tool_calls" and calls, choice
    assert most is None or len(calls) <= most
    for call in calls:
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            PARAMS[call["function"]["name"]])
    return calls


NAMED = {"type": "function", "function": {"name": "set_alarm"}}


@pytest.mark.parametrize("served", ["hermes_server", "coder_server"])
def test_required_and_named_tool_choice_give_valid_calls(request, served):
    server = request.getfixturevalue(served)
    bodies = [tool_body("required", n=2, parallel_tool_calls=False),
              tool_body(NAMED, n=2)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        single, named = pool.map(lambda b: ok(server, "chat/completions", b), bodies)
    for choice in single["choices"]:
        assert len(assert_valid_calls(choice, set(PARAMS), most=1)) == 1
    for choice in named["choices"]:
        assert len(assert_valid_calls(choice, {"set_alarm"}, most=1)) == 1


@pytest.mark.parametrize("served", ["hermes_server", "coder_server"])
def test_streamed_tool_calls_are_the_non_streamed_ones(request, served):
    server = request.getfixturevalue(served)
    body = tool_body("required", seed=8)
    whole = ok(server, "chat/completions", body)["choices"][0]
    assert_valid_calls(whole, set(PARAMS))
    assert streamed(server, "chat/completions", body) == [joined(whole)]


MOOD = {"type": "object", "properties": {
    "mood": {"type": "string", "enum": ["calm", "busy"]},
    "level": {"type": "integer", "minimum": 1, "maximum": 5},
    "tag": {"type": "string", "maxLength": 8}},
    "required": ["mood", "level"], "additionalProperties": False}
# The random model rarely writes </think> by itself: a bias makes it end reasoning after a few
# tokens; the grammar then bans </think> from the answer.
END_THINKING_SOON = {"logit_bias": {str(THINK_END): 11}}


def test_reasoning_is_free_and_the_answer_obeys_the_schema(hermes_server):
    body = {"messages": [{"role": "user", "content": "How are you?"}], "temperature": 1,
            "seed": 7, "max_tokens": 120, "n": 10, **END_THINKING_SOON,
            "response_format": {"type": "json_schema", "json_schema": {"name": "m",
                                                                       "schema": MOOD}}}
    tools = tool_body("required", n=4, **END_THINKING_SOON)
    del tools["chat_template_kwargs"]  # thinking on: the calls come after </think>
    with ThreadPoolExecutor(2) as pool:
        answers, calls = pool.map(lambda b: ok(hermes_server, "chat/completions", b),
                                  [body, tools])
    for choice in answers["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), MOOD)
    for choice in calls["choices"]:
        assert_valid_calls(choice, set(PARAMS))
    reasoning = [c["message"]["reasoning_content"] for c in answers["choices"] + calls["choices"]]
    assert sum(bool(r) for r in reasoning) >= 7  # free text, where the schema never applied
    one = {**body, "n": 1}
    whole = ok(hermes_server, "chat/completions", one)["choices"][0]
    assert streamed(hermes_server, "chat/completions", one) == [joined(whole)]


def test_harmony_calls_and_answers_under_their_grammars(harmony_server):
    """The scripted Harmony model writes its scripts; the grammars allow exactly those."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    body = {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": tools,
            "tool_choice": "required", "temperature": 0, "max_tokens": 60}
    [call] = ok(harmony_server, "chat/completions", body)["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    body = {"messages": [{"role": "user", "content": "hello"}], "temperature": 0,
            "max_tokens": 60, "guided_choice": ["Use a <b> tag.", "No."]}
    message = ok(harmony_server, "chat/completions", body)["choices"][0]["message"]
    assert message["content"] == "Use a <b> tag." and message["reasoning_content"]


# Schemas from hypothesis: valid ones, broken ones and garbage. Whatever comes, the answer is
# a 200 or a 4xx, never a 5xx, and the server keeps serving.
LEAF = st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number",
                                                       "boolean", "null", "strin", 3])},
                             optional={"minimum": st.integers(-5, 5),
                                       "maximum": st.integers(-5, 5),
                                       "maxLength": st.integers(-1, 4),
                                       "pattern": st.sampled_from(["^[a-c]+$", "((", "x*"]),
                                       "enum": st.lists(st.integers(0, 3) | st.text(max_size=3),
                                                        max_size=3),
                                       "format": st.sampled_from(["date", "email", "bogus"])})
SCHEMA = st.recursive(LEAF, lambda inner: st.fixed_dictionaries(
    {"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=4), inner,
                                                              max_size=3)},
    optional={"required": st.lists(st.text(max_size=4), max_size=2),
              "additionalProperties": st.booleans()})
    | st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                            optional={"minItems": st.integers(-1, 3),
                                      "maxItems": st.integers(0, 3)})
    | st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)})
    | st.fixed_dictionaries({"$ref": st.sampled_from(["#/$defs/x", "#", "http://x"])}),
    max_leaves=6)
GARBAGE = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                       lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=5)
FIELDS = st.one_of(
    SCHEMA.map(lambda s: {"guided_json": s}),
    SCHEMA.map(lambda s: {"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "x", "schema": s}}}),
    SCHEMA.map(lambda s: {"structured_outputs": {"json": json.dumps(s)}}),
    GARBAGE.map(lambda g: {"guided_json": g}),
    GARBAGE.map(lambda g: {"response_format": g}),
    GARBAGE.map(lambda g: {"structured_outputs": g}),
    GARBAGE.map(lambda g: {"guided_choice": g}),
    st.text(max_size=8).map(lambda t: {"guided_regex": t}),
    st.text(max_size=12).map(lambda t: {"guided_grammar": t}),
    st.fixed_dictionaries({"guided_json": SCHEMA, "guided_whitespace_pattern": GARBAGE}),
)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(fields=FIELDS, chat=st.booleans())
def test_fuzzed_schemas_never_5xx(default_server, fields, chat):
    body = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "Hi"})
    raw = json.dumps({**body, "max_tokens": 4, "temperature": 0, **fields})
    r = httpx.post(f"{default_server.url}/v1/{'chat/completions' if chat else 'completions'}",
                   content=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert r.status_code < 500, (fields, r.text[:500])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_the_server_still_serves_after_the_fuzz(default_server):
    answer = ok(default_server, "completions", {"prompt": "Hi", "max_tokens": 3,
                                                "guided_choice": ["a", "b"]})
    assert answer["choices"][0]["text"] in ("a", "b")
    assert httpx.get(f"{default_server.url}/health").status_code == 200
