"""Structured outputs at the HTTP edge (serving/openai/structured.py, parsed with the request): every
request form becomes its `StructuredSpec`, every bad value or conflict is a 400 naming the
field, before and after llguidance compiles it, and chat places the grammar after the
reasoning (serving/openai/chat.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from freetoken.config import FrontendConfig
from freetoken.core import StructuredSpec
from pydantic import ValidationError

from freetoken.serving.openai import chat as chat_endpoint
from freetoken.serving.openai import structured
from freetoken.serving.errors import RequestError, validation_error
from freetoken.serving.limits import Limits
from freetoken.serving.openai.protocol import ChatCompletionRequest, CompletionRequest

LIMITS = Limits(vocab_size=1000)
MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WS = structured.DEFAULT_WHITESPACE


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="x", **fields)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


def schema_spec(schema: dict, **guidance) -> StructuredSpec:
    return StructuredSpec("json_schema", json.dumps({**schema, "x-guidance": guidance}))


FORMS = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}},
     schema_spec({"type": "object"}, whitespace_pattern=WS)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     schema_spec(SCHEMA, whitespace_pattern=WS)),
    ({"guided_json": SCHEMA}, schema_spec(SCHEMA, whitespace_pattern=WS)),
    ({"guided_json": json.dumps(SCHEMA)}, schema_spec(SCHEMA, whitespace_pattern=WS)),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
     schema_spec(SCHEMA, whitespace_pattern=" ?")),
    ({"guided_json": {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}},
     schema_spec(SCHEMA, whitespace_flexible=False)),
    ({"guided_regex": "[0-9]{3}"}, StructuredSpec("regex", "[0-9]{3}")),
    ({"guided_choice": ["yes", "no"]}, StructuredSpec("choice", '["yes", "no"]')),
    ({"guided_grammar": 'root ::= "a" | "b"'}, StructuredSpec("grammar", 'root ::= "a" | "b"')),
    ({"structured_outputs": {"json": SCHEMA}}, schema_spec(SCHEMA, whitespace_pattern=WS)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     schema_spec(SCHEMA, whitespace_flexible=False)),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "\n?"}},
     schema_spec(SCHEMA, whitespace_pattern="\n?")),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": ""},
     schema_spec(SCHEMA, whitespace_pattern="")),
    ({"structured_outputs": {"json_object": True}},
     schema_spec({"type": "object"}, whitespace_pattern=WS)),
    ({"structured_outputs": {"regex": "a+", "disable_fallback": True}},
     StructuredSpec("regex", "a+")),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredSpec("choice", '["x"]')),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, StructuredSpec("grammar", 'start: "a"')),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, StructuredSpec("regex", "a")),
    ({"guided_decoding_backend": "auto"}, None),
]


@pytest.mark.parametrize("make", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("fields,spec", FORMS)
def test_every_form_becomes_its_spec(make, fields, spec):
    req = make(**fields)  # parsed, so none of the fields is refused as unknown
    assert req.to_sampling_params(LIMITS).structured == spec
    assert (req.structured_output.spec if req.structured_output else None) == spec


INVALID = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"schema": {}, "strict": "yes"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_json": [SCHEMA]}, "guided_json"),
    ({"guided_json": {"type": "number", "minimum": float("nan")}}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": ["a"]}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_grammar": {"x": 1}}, "guided_grammar"),
    ({"guided_decoding_backend": "mystery"}, "guided_decoding_backend"),
    ({"guided_decoding_backend": 3}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_whitespace_pattern": 1, "guided_json": SCHEMA}, "guided_whitespace_pattern"),
    ({"guided_whitespace_pattern": "((", "guided_json": SCHEMA}, "guided_whitespace_pattern"),
    ({"guided_whitespace_pattern": " ", "guided_regex": "a"}, "guided_whitespace_pattern"),
    ({"guided_whitespace_pattern": " ", "structured_outputs": {"regex": "a"}},
     "guided_whitespace_pattern"),
    ({"guided_whitespace_pattern": " ",
      "structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
     "guided_whitespace_pattern"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": "x"}},
     "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs"),
    # One structured output per request: the second field is named.
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a"}, "guided_grammar": "x"}, "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
]


@pytest.mark.parametrize("make", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("fields,param", INVALID)
def test_invalid_values_and_conflicts_name_the_field(make, fields, param):
    with pytest.raises(ValidationError) as exc:
        make(**fields)  # refused as the request is parsed
    err = validation_error(exc.value)
    assert err.param == param and err.status == 400, err.message


def test_unknown_fields_are_still_refused():
    with pytest.raises(ValidationError) as exc:
        completion(guided_jsonn={})
    assert validation_error(exc.value).param == "guided_jsonn"


def fake_state(tokenizer=None):
    config = FrontendConfig(served_model_name="m", max_model_len=512, vocab_size=248320,
                            reasoning_parser="qwen3", tool_call_parser="hermes")
    return SimpleNamespace(config=config, tokenizer=tokenizer)


UNCOMPILABLE = [
    ({"guided_json": {"type": "foo"}}, "guided_json", "Invalid type"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json",
     "Unsatisfiable"),
    ({"guided_json": {"properties": {"a": {"$ref": "#/nope"}}}}, "guided_json", "nope"),
    ({"guided_json": {"type": "string", "pattern": "(("}}, "guided_json", "unclosed group"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
     "response_format", ""),
    ({"guided_regex": "a("}, "guided_regex", "unclosed group"),
    ({"guided_grammar": "x"}, "guided_grammar", "GBNF"),
    ({"guided_grammar": "start: foo"}, "guided_grammar", "unknown name"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", "unknown name"),
]


@pytest.mark.parametrize("fields,param,words", UNCOMPILABLE)
def test_what_llguidance_cannot_compile_is_a_400_with_its_message(fields, param, words):
    found = completion(**fields).structured_output
    with pytest.raises(RequestError) as exc:
        asyncio.run(structured.check(fake_state(), found.spec, found.field))
    assert exc.value.param == param and words in exc.value.message


def test_compiled_results_are_cached_by_spec():
    spec = StructuredSpec("regex", "[a-z]{1,5}")
    asyncio.run(structured.check(fake_state(), spec, "guided_regex"))
    hits = structured._error.cache_info().hits
    asyncio.run(structured.check(fake_state(), StructuredSpec("regex", "[a-z]{1,5}", (5,)),
                                 "guided_regex"))
    assert structured._error.cache_info().hits == hits + 1


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


def for_chat(tokenizer=None, reasoning=None, tool_parser="hermes", ctk=None, **fields):
    """Chat's grammar and the field it names, from the request's parsed values."""
    req = chat(**fields)
    found = chat_endpoint.output_grammar(req.structured_output, req.tool_dicts, req.tool_choice,
                                   req.parallel_tool_calls is not False, tool_parser, reasoning,
                                   ctk or {}, tokenizer)
    return (found.spec, found.field) if found else (None, None)


def test_reasoning_stays_free_and_the_answer_follows_the_grammar(qwen35_tokenizer):
    think_end = qwen35_tokenizer.convert_tokens_to_ids("</think>")
    spec, param = for_chat(qwen35_tokenizer, "qwen3", guided_regex="a")
    assert spec == StructuredSpec("regex", "a", (think_end,)) and param == "guided_regex"
    spec, _ = for_chat(qwen35_tokenizer, "qwen3", ctk={"enable_thinking": False},
                       guided_regex="a")
    assert spec.after_ids == ()  # the template closed the think block: the answer starts at once
    spec, param = for_chat(qwen35_tokenizer, "qwen3", tools=TOOLS, tool_choice="required")
    assert spec.kind == "lark" and spec.after_ids == (think_end,) and param == "tools"


def test_a_reasoning_end_that_is_not_a_fixed_token_sequence_is_a_400():
    from transformers import AutoTokenizer

    from tests.model_fixtures import tiny_random_folder

    plain = AutoTokenizer.from_pretrained(tiny_random_folder("qwen3"))  # no </think> token
    with pytest.raises(RequestError) as exc:
        for_chat(plain, "qwen3", response_format={"type": "json_object"})
    assert exc.value.param == "response_format" and "qwen3" in exc.value.message


def test_harmony_answers_after_the_final_channel_header(tiny_harmony_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_harmony_path)
    spec, _ = for_chat(tok, "gpt_oss", "gpt_oss", guided_choice=["a"])
    assert tok.decode(list(spec.after_ids), skip_special_tokens=False) == \
        "<|channel|>final<|message|>"
    spec, _ = for_chat(tok, "gpt_oss", "gpt_oss", tools=TOOLS, tool_choice="required")
    assert spec.kind == "lark" and spec.after_ids == ()  # its grammar spans the analysis


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forced_tool_calls_without_a_tool_parser_are_written_as_hermes_calls(choice):
    assert chat_endpoint.call_format(None, TOOLS, choice) == "hermes"
    spec, param = for_chat(tool_parser=chat_endpoint.call_format(None, TOOLS, choice),
                           tools=TOOLS, tool_choice=choice)
    assert spec.kind == "lark" and "<tool_call>" in spec.value and param == "tools"


def test_free_tool_choices_without_a_tool_parser_parse_no_calls():
    assert chat_endpoint.call_format(None, TOOLS, "auto") is None
    assert chat_endpoint.call_format(None, None, "required") is None
    assert chat_endpoint.call_format("qwen3_coder", TOOLS, "required") == "qwen3_coder"


def test_forced_tool_calls_and_a_response_format_do_not_combine():
    with pytest.raises(RequestError) as exc:
        for_chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert exc.value.param == "response_format"


def test_auto_and_none_leave_the_output_free():
    assert for_chat(tools=TOOLS, tool_choice="auto") == (None, None)
    assert for_chat(tools=TOOLS, tool_choice="none") == (None, None)


def test_a_tool_schema_llguidance_rejects_names_tools():
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]
    spec, param = for_chat(tools=bad, tool_choice="required")
    with pytest.raises(RequestError) as exc:
        asyncio.run(structured.check(fake_state(), spec, param))
    assert exc.value.param == "tools"
