"""The tool-call grammars (parsing/tool_grammar.py) on the real Qwen3.5 vocabulary: they accept
each parser's own reference outputs and reject wrong ones, and every output they let a model
write (random walks through llguidance's token masks) parses with the real parser into calls
whose arguments validate against the tool's schema."""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import numpy as np
import pytest
from freetoken.parsing import registry, tool_grammar
from freetoken.structured.grammar import ll_tokenizer

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "New York"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "note": {"type": "string", "maxLength": 12},
}, "required": ["city"], "additionalProperties": False}
FLAG = {"type": "object", "properties": {
    "on": {"type": "boolean"},
    "level": {"type": "number", "minimum": 0, "maximum": 1},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["x"], "additionalProperties": False},
}, "required": ["on"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_flag", "parameters": FLAG}},
         {"type": "function", "function": {"name": "ping"}}]
SCHEMAS = {"get_weather": WEATHER, "set_flag": FLAG, "ping": {"type": "object"}}


@pytest.fixture(scope="module")
def ll(qwen35_tokenizer):
    return ll_tokenizer(qwen35_tokenizer, 248320, [qwen35_tokenizer.eos_token_id])


def grammar(tok, tool: str, name: str | None = None, parallel: bool = True) -> str:
    text, _ = registry.tool_call_grammar(tool, TOOLS, name, parallel,
                                         tool_grammar.token_literal(tok))
    return llguidance.grammar_from("lark", text)


def accepts(ll, tok, g: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll, g, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) \
        and matcher.is_accepting()


def hermes(*calls: tuple[str, dict]) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
                     for n, a in calls)


def raw(v) -> str:
    """A tag format's value: a string as it is, anything else JSON."""
    return v if isinstance(v, str) else json.dumps(v)


def coder(*calls: tuple[str, dict]) -> str:
    return "\n".join(f"<tool_call>\n<function={n}>\n" + "".join(
        f"<parameter={k}>\n{raw(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>" for n, a in calls)


def glm(*calls: tuple[str, dict]) -> str:
    return "\n".join(f"<tool_call>{n}\n" + "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{raw(v)}</arg_value>\n" for k, v in a.items())
        + "</tool_call>" for n, a in calls)


def mistral(*calls: tuple[str, dict]) -> str:
    """v3's array: this vocabulary holds no [ARGS] token."""
    return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def granite(*calls: tuple[str, dict]) -> str:
    return "<|tool_call|>" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def phi4_mini(*calls: tuple[str, dict]) -> str:
    return "functools" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


FORMATS = {"hermes": hermes, "qwen3_coder": coder, "glm45": glm, "mistral": mistral,
           "granite": granite, "phi4_mini_json": phi4_mini}
GOOD = [
    [("get_weather", {"city": "Paris"})],
    [("get_weather", {"city": "New York", "days": 7, "note": "bring\nrain"})],
    [("set_flag", {"on": True, "level": 0.25, "tags": ["b", "a"], "point": {"x": 3}})],
    [("ping", {})],
    [("get_weather", {"city": "Oslo", "days": 1}), ("set_flag", {"on": False})],
]
BAD = [
    [("get_weather", {"city": "Rome"})],  # not in the enum
    [("get_weather", {"days": 3})],  # city is required
    [("get_weather", {"city": "Paris", "days": 8})],  # above the maximum
    [("get_weather", {"city": "Paris", "note": "far too long a note"})],  # over maxLength
    [("get_weather", {"city": "Paris", "wind": 3})],  # not a parameter
    [("set_flag", {"on": "yes"})],  # not a boolean
    [("set_flag", {"on": True, "tags": ["a", "b", "a"]})],  # over maxItems
    [("set_flag", {"on": True, "point": {"x": 3, "y": 1}})],  # not in the sub-schema
    [("search", {"q": "x"})],  # not a tool
]


def parsed_calls(tool: str, text: str) -> list[tuple[str, dict]]:
    step = registry.parse_text(text, None, tool, TOOLS)
    assert step.content.strip() == ""
    return [(c.name, json.loads(c.parameters)) for c in step.calls]


@pytest.mark.parametrize("tool", FORMATS)
@pytest.mark.parametrize("calls", GOOD, ids=range(len(GOOD)))
def test_reference_outputs_are_accepted_and_parse_back(ll, qwen35_tokenizer, tool, calls):
    text = FORMATS[tool](*calls)
    assert accepts(ll, qwen35_tokenizer, grammar(qwen35_tokenizer, tool), text)
    assert parsed_calls(tool, text) == calls
    if len(calls) == 1:
        named = grammar(qwen35_tokenizer, tool, calls[0][0])
        assert accepts(ll, qwen35_tokenizer, named, text)


@pytest.mark.parametrize("tool", FORMATS)
@pytest.mark.parametrize("calls", BAD, ids=range(len(BAD)))
def test_wrong_calls_are_rejected(ll, qwen35_tokenizer, tool, calls):
    assert not accepts(ll, qwen35_tokenizer, grammar(qwen35_tokenizer, tool),
                       FORMATS[tool](*calls))


@pytest.mark.parametrize("tool", FORMATS)
def test_wrong_shapes_are_rejected(ll, qwen35_tokenizer, tool):
    fmt, tok = FORMATS[tool], qwen35_tokenizer
    one, two = ("ping", {}), ("set_flag", {"on": True})
    assert not accepts(ll, tok, grammar(tok, tool), "")  # no call at all
    assert not accepts(ll, tok, grammar(tok, tool), "Sure. " + fmt(one))
    assert not accepts(ll, tok, grammar(tok, tool), fmt(one) + " done")
    assert not accepts(ll, tok, grammar(tok, tool, "set_flag"), fmt(one))  # not the named one
    assert not accepts(ll, tok, grammar(tok, tool, "set_flag"), fmt(two, two))  # exactly one
    assert not accepts(ll, tok, grammar(tok, tool, parallel=False), fmt(one, two))
    if tool in ("mistral", "granite", "phi4_mini_json"):  # their openers are text here
        return
    # <tool_call> is one added token in this vocabulary, and only that token opens a call.
    spelled = list(tok.encode(fmt(one), add_special_tokens=False))
    assert spelled[0] == tok.convert_tokens_to_ids("<tool_call>")
    matcher = llguidance.LLMatcher(ll, grammar(tok, tool), log_level=0)
    assert not matcher.consume_tokens(tok.encode("<tool", add_special_tokens=False))


def test_a_qwen3_coder_string_cannot_hold_a_closing_tag(ll, qwen35_tokenizer):
    text = coder(("get_weather", {"city": "Paris", "note": "a</function>"}))
    assert not accepts(ll, qwen35_tokenizer, grammar(qwen35_tokenizer, "qwen3_coder"), text)


@pytest.mark.parametrize("note", ["a</arg_value>", " padded", "padded\n"])
def test_a_glm45_string_holds_no_tag_nor_what_the_parser_strips(ll, qwen35_tokenizer, note):
    text = glm(("get_weather", {"city": "Paris", "note": note}))
    assert not accepts(ll, qwen35_tokenizer, grammar(qwen35_tokenizer, "glm45"), text)


def walk(ll, g: str, rng: random.Random, limit: int = 120) -> list[int] | None:
    """A random output the grammar allows: each token drawn uniformly from the mask, EOS
    taken as soon as it is allowed (None if `limit` tokens do not finish it)."""
    matcher = llguidance.LLMatcher(ll, g, log_level=0)
    eos = ll.eos_token
    out: list[int] = []
    for _ in range(limit):
        mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                             bitorder="little")
        allowed = np.flatnonzero(mask[: ll.vocab_size])
        if mask[eos]:
            return out
        token = int(allowed[rng.randrange(len(allowed))])
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    return None


@pytest.mark.parametrize("tool", FORMATS)
@pytest.mark.parametrize("name", [None, "get_weather", "set_flag"])
def test_whatever_the_grammar_allows_parses_into_valid_calls(ll, qwen35_tokenizer, tool, name):
    rng = random.Random(f"{tool}-{name}")
    g = grammar(qwen35_tokenizer, tool, name)
    finished = 0
    for _ in range(4):
        ids = walk(ll, g, rng)
        if ids is None:
            continue
        finished += 1
        calls = parsed_calls(tool, qwen35_tokenizer.decode(ids, skip_special_tokens=False))
        assert calls and (name is None or [n for n, _ in calls] == [name])
        for called, args in calls:
            jsonschema.validate(args, SCHEMAS[called])
    assert finished


def test_harmony_reference_call_is_accepted_and_parses(tiny_harmony_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_harmony_path)
    ll = ll_tokenizer(tok, 1024)
    head = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
    call = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city":"Oslo","days":2}')
    spaced = call.replace('":', '": ').replace(',"', ', "')  # both layouts occur
    for text in (head + call, call, head + spaced):
        assert accepts(ll, tok, grammar(tok, "gpt_oss"), text)
        assert accepts(ll, tok, grammar(tok, "gpt_oss", "get_weather"), text)
        step = registry.parse_text(text, "gpt_oss", "gpt_oss", TOOLS)
        assert [(c.name, json.loads(c.parameters)) for c in step.calls] == \
            [("get_weather", {"city": "Oslo", "days": 2})]
    assert not accepts(ll, tok, grammar(tok, "gpt_oss", "set_flag"), head + call)
    assert not accepts(ll, tok, grammar(tok, "gpt_oss"), call.replace("Oslo", "Rome"))
    assert not accepts(ll, tok, grammar(tok, "gpt_oss"),
                       head + "<|channel|>final<|message|>It is sunny.")


def test_markers_that_are_not_added_tokens_are_matched_as_text():
    from transformers import AutoTokenizer

    from tests.model_fixtures import tiny_random_folder

    tok = AutoTokenizer.from_pretrained(tiny_random_folder("qwen3"))  # SmolLM2's vocabulary
    literal = tool_grammar.token_literal(tok)
    assert literal("<tool_call>") == '"<tool_call>"'
    ll = ll_tokenizer(tok, len(tok))
    text = hermes(("get_weather", {"city": "Oslo"}))
    assert accepts(ll, tok, grammar(tok, "hermes"), text)
