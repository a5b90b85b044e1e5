"""The tool-call stage through the output parser on text alone: turns generated from known
calls and rendered in each format must parse back to those calls, in one piece and in any
chunking; plus truncation, typed qwen3_coder and glm45 values, Harmony, mistral's two layouts,
the JSON lists of granite and phi4_mini_json and the reasoning -> tool pipeline."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from freetoken.parsing import registry
from freetoken.parsing.call_list import GraniteDetector, Phi4MiniDetector
from freetoken.parsing.calls import Detector, ToolCallItem
from freetoken.parsing.glm45 import Glm45Detector, glm_value
from freetoken.parsing.harmony import HarmonyDetector
from freetoken.parsing.hermes import HermesDetector
from freetoken.parsing.mistral import MistralDetector
from freetoken.parsing.qwen3_coder import Qwen3CoderDetector, convert_param_value
from tests.parsing.support import TOOLS

FAST = settings(max_examples=120, deadline=None)


FORMATS = ["hermes", "qwen3_coder", "gpt_oss", "glm45", "mistral", "granite", "phi4_mini_json"]


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c for c in cuts if 0 < c < len(text)})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def tool_parser(parser_name: str):
    return registry.output_parser(tool=parser_name, tools=TOOLS)


def run_stream(parser_name: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[ToolCallItem]]:
    """(normal_text, [(name, arguments)], raw items) from a streamed parse."""
    parser = tool_parser(parser_name)
    results = [parser.feed_text(p) for p in pieces] + [parser.finish()]
    items = [item for r in results for item in r.calls]
    calls: dict[int, list[str]] = {}
    for item in items:
        entry = calls.setdefault(item.tool_index, ["", ""])
        if item.name is not None:
            assert entry == ["", ""], "the name comes first, once"
            entry[0] = item.name
        entry[1] += item.parameters
    assert list(calls) == list(range(len(calls)))
    return "".join(r.content for r in results), [tuple(v) for v in calls.values()], items


def non_stream(parser_name: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    result = registry.parse_text(text, tool=parser_name, tools=TOOLS)
    assert [c.tool_index for c in result.calls] == list(range(len(result.calls)))
    return result.content, [(c.name, c.parameters) for c in result.calls]


def assert_all_paths(parser_name: str, text: str, normal: str, calls: list[tuple[str, dict]], pieces=None):
    """Non-stream, one-char stream and ``pieces`` all give ``normal`` and ``calls``."""
    got = non_stream(parser_name, text)
    assert got[0] == normal
    assert [(n, json.loads(a)) for n, a in got[1]] == calls
    for chunks in ([text], list(text), pieces or []):
        if chunks:
            s_normal, s_calls, _ = run_stream(parser_name, chunks)
            assert (s_normal, s_calls) == got, chunks


# ------------------------------------------------------------------ rendering known calls


def render_call(fmt: str, name: str, args: dict, variant: int = 0) -> str:
    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
    if fmt == "qwen3_coder":
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                         for k, v in args.items())
        body = f"<function={name}>\n{params}</function>"
        return body if variant % 2 else f"<tool_call>\n{body}\n</tool_call>"
    if fmt == "glm45":  # as GLM-4.5's chat template writes a call
        pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>"
                        f"{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                        for k, v in args.items())
        return f"<tool_call>{name}\n{pairs}</tool_call>"
    if fmt == "mistral":  # v3's one-call array, v13's [ARGS], v11's [CALL_ID]
        if variant % 3 == 0:
            return "[TOOL_CALLS] " + json.dumps([{"name": name, "arguments": args}])
        call_id = "[CALL_ID]a1B2c3D4e" if variant % 3 == 2 else ""
        return f"[TOOL_CALLS]{name}{call_id}[ARGS]{json.dumps(args)}"
    if fmt in ("granite", "phi4_mini_json"):  # a one-call list; Granite 3.1's <tool_call> too
        opener = "functools" if fmt == "phi4_mini_json" else ("<tool_call>", "<|tool_call|>")[variant % 2]
        return opener + json.dumps([{"name": name, "arguments": args}], ensure_ascii=False)
    start = "<|start|>assistant" if variant % 2 else ""
    constrain = " <|constrain|>json" if variant % 3 else ""
    return f"{start}<|channel|>commentary to=functions.{name}{constrain}<|message|>{json.dumps(args)}<|call|>"


MARKER_FREE = st.text(alphabet=st.sampled_from(list("abc xyz\n\t<>/|{}\"'=é😀")), max_size=20).filter(
    lambda t: not any(m in t for m in ("<tool_call>", "</tool_call>", "<function=", "</function>",
                                       "<parameter=", "</parameter>", "<|")))


def stripped(args: dict) -> dict:
    """glm45 strips every value (the template writes them as they are)."""
    return {k: v.strip() if isinstance(v, str) else v for k, v in args.items()}
ARGS = {
    "get_weather": st.fixed_dictionaries({"city": MARKER_FREE}, optional={"days": st.integers(-5, 10**6),
                                                                          "metric": st.booleans()}),
    "write_file": st.fixed_dictionaries({"path": MARKER_FREE, "content": MARKER_FREE}),
    "configure": st.fixed_dictionaries({}, optional={
        "ratio": st.floats(-1e6, 1e6, allow_nan=False).filter(lambda f: f != int(f)),
        "opts": st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 9), max_size=2),
        "tags": st.lists(st.sampled_from(["x", "y"]), max_size=3),
        "limit": st.none() | st.integers(0, 99),
    }),
}
CALL = st.sampled_from(sorted(ARGS)).flatmap(lambda n: st.tuples(st.just(n), ARGS[n]))


@st.composite
def turns(draw):
    fmt = draw(st.sampled_from(FORMATS))
    prefix = draw(MARKER_FREE)
    calls = draw(st.lists(CALL, max_size=3))
    seps = [draw(st.sampled_from(["", "\n", "\n\n", " \n"])) for _ in calls]
    suffix = draw(st.sampled_from(["", "\n", "\n\nDone.", " ok "]))
    text = prefix + "".join(sep + render_call(fmt, n, a, draw(st.integers(0, 5))) for sep, (n, a) in zip(seps, calls))
    text += suffix if calls else ""
    # Leading whitespace of the turn and whitespace after each call are dropped.
    normal = (prefix + seps[0]).lstrip() + suffix.lstrip() if calls else prefix.lstrip()
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=len(text) // 2 + 1))
    if fmt == "glm45":
        calls = [(n, stripped(a)) for n, a in calls]
    return fmt, text, normal, calls, split(text, cuts)


@FAST
@given(turns())
def test_known_calls_parse_back_in_any_chunking(case):
    fmt, text, normal, calls, pieces = case
    assert_all_paths(fmt, text, normal, [(n, a) for n, a in calls], pieces)


@FAST
@given(turns(), st.data())
def test_truncated_turns_agree_between_paths(case, data):
    fmt, text, _, calls, _ = case
    cut = text[: data.draw(st.integers(0, len(text)))]
    expected = non_stream(fmt, cut)
    pieces = split(cut, data.draw(st.lists(st.integers(0, len(cut)), max_size=10)))
    assert run_stream(fmt, pieces)[:2] == expected
    assert run_stream(fmt, list(cut))[:2] == expected
    if fmt == "hermes":  # rendered as the parser writes arguments: a cut call's are a prefix
        for (_, arguments), (_, args) in zip(expected[1], calls):
            assert json.dumps(args, ensure_ascii=False).startswith(arguments)


NOISE = ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=", "</function>", "<parameter=city>",
         "<parameter=days>", "</parameter>", "<|start|>assistant", "<|channel|>", "commentary to=functions.get_weather",
         "<|constrain|>json", "<|message|>", "<|call|>", "<|end|>", '{"name": "get_weather", "arguments": ', "{", "}",
         '"city": ', '"Oslo"', ", ", "12", "true", "\n", " ", "<", "</", "<|", "x", "é",
         "<tool_call>get_weather\n", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "city",
         "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "get_weather", "[", "]", '{"city": "Oslo"}',
         "<|tool_call|>", "functools", "func", "tools", '[{"name": "get_weather", "arguments": ']


@FAST
@given(st.sampled_from(FORMATS), st.lists(st.sampled_from(NOISE), max_size=30), st.data())
def test_noisy_markup_agrees_between_paths(fmt, parts, data):
    text = "".join(parts)
    expected = non_stream(fmt, text)
    pieces = split(text, data.draw(st.lists(st.integers(0, len(text)), max_size=15)))
    assert run_stream(fmt, pieces)[:2] == expected
    assert run_stream(fmt, list(text))[:2] == expected


# ------------------------------------------------------------------ scripted cases

SCRIPTED = [
    # (format, output, normal_text, calls)
    ("hermes", "", "", []),
    ("hermes", "Just an answer, <b>bold</b>.", "Just an answer, <b>bold</b>.", []),
    ("hermes", "\n\n" + render_call("hermes", "get_weather", {"city": "Paris"}), "", [("get_weather", {"city": "Paris"})]),
    (
        "hermes",
        "Checking both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Köln\"}}\n</tool_call>\n",
        "Checking both.\n",
        [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Köln"})],
    ),
    ("hermes", render_call("hermes", "get_weather", {"city": "Rome"}) + "\n\nAnything else?", "Anything else?",
     [("get_weather", {"city": "Rome"})]),
    ("hermes", '<tool_call>\n{"arguments": {"x": 1}, "name": "unknown_fn"}\n</tool_call>', "", [("unknown_fn", {"x": 1})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>', "",
     [("get_weather", {"city": "Oslo"})]),
    ("hermes", '<tool_call>\n{"name": "get_weather"}\n</tool_call>', "", [("get_weather", {})]),
    # the model forgot the outer brace: the closer still ends the call
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}\n</tool_call>ok', "ok",
     [("get_weather", {"city": "Nice"})]),
    # truncated mid-call: the arguments as far as they came
    # truncated before the name: nothing was streamed as a call, so it stays text
    ("hermes", 'Hi <tool_call>\n{"na', 'Hi <tool_call>\n{"na', []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("hermes", "a <tool_ca", "a <tool_ca", []),
    (
        "qwen3_coder",
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n5\n"
        "</parameter>\n<parameter=metric>\nFalse\n</parameter>\n</function>\n</tool_call>\nDone!",
        "Sure.\nDone!",
        [("get_weather", {"city": "New York", "days": 5, "metric": False})],
    ),
    ("qwen3_coder", "Text <function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function> after",
     "Text after", [("get_weather", {"city": "Paris"})]),
    (
        "qwen3_coder",
        "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n\n"
        "def f():\n    return '<b>'\n\n</parameter>\n</function>\n</tool_call>",
        "",
        [("write_file", {"path": "a.py", "content": "\ndef f():\n    return '<b>'\n"})],
    ),
    ("qwen3_coder", "<tool_call>\n<function=mystery>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>", "",
     [("mystery", {"n": "7"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew Yo", "", [("get_weather", {"city": "New Yo"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</param", "", [("get_weather", {"city": "Paris"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\n4", "", [("get_weather", {"days": 4})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weath", "<tool_call>\n<function=get_weath", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n", "", [("get_weather", {})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<para", "",
     [("get_weather", {"city": "Paris"})]),
    ("qwen3_coder", "<tool_call>\n{\"name\": \"x\"}\n</tool_call>", "<tool_call>\n{\"name\": \"x\"}\n</tool_call>", []),
    # missing </parameter> and </function>: the next tag and the wrapper closer end them
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n<parameter=days>\n2\n</tool_call>",
     "", [("get_weather", {"city": "Lima", "days": 2})]),
    ("gpt_oss", render_call("gpt_oss", "get_weather", {"city": "Oslo"}, 1), "", [("get_weather", {"city": "Oslo"})]),
    ("gpt_oss", "<|channel|>commentary to=functions.get_weather<|message|>{\"city\": \"Oslo\", \"days\": 2}<|call|>", "",
     [("get_weather", {"city": "Oslo", "days": 2})]),
    ("gpt_oss", "Let me look.<|channel|>commentary to=functions.get_weather json<|message|>{}<|end|>", "Let me look.",
     [("get_weather", {})]),
    ("gpt_oss", "<|channel|>commentary to=functions.get_weather<|message|>{\"city\": \"Oslo\"}", "",
     [("get_weather", {"city": "Oslo"})]),
    (
        "glm45",
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value> New York\n</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>5</arg_value>\n</tool_call>\n<tool_call>get_weather\n"
        "<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n</tool_call>",
        "Let me check.\n",
        [("get_weather", {"city": "New York", "days": 5}), ("get_weather", {"metric": True})],
    ),
    # an unknown tool's (or undeclared parameter's) values are read as JSON, as vLLM's
    ("glm45", "<tool_call>mystery\n<arg_key>n</arg_key>\n<arg_value>7</arg_value>\n<arg_key>s</arg_key>\n"
     "<arg_value>seven</arg_value>\n</tool_call>", "", [("mystery", {"n": 7, "s": "seven"})]),
    ("glm45", "<tool_call>configure\n<arg_key>opts</arg_key>\n<arg_value>{\\\"a\\\": 1}</arg_value>\n"
     "<arg_key>tags</arg_key>\n<arg_value>['x', 'y']</arg_value>\n<arg_key>limit</arg_key>\n"
     "<arg_value>null</arg_value>\n</tool_call>", "", [("configure", {"opts": {"a": 1}, "tags": ["x", "y"],
                                                                        "limit": None})]),
    # GLM-4.7's layout, without newlines; a call without arguments
    ("glm45", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", "",
     [("get_weather", {"city": "Paris"})]),
    ("glm45", "<tool_call>get_weather\n</tool_call> ok", "ok", [("get_weather", {})]),
    # missing </arg_value>: the next tag ends the value
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lima\n<arg_key>days</arg_key>\n"
     "<arg_value>2</tool_call>", "", [("get_weather", {"city": "Lima", "days": 2})]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New Yo", "",
     [("get_weather", {"city": "New Yo"})]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_v", "",
     [("get_weather", {"city": "Paris"})]),
    ("glm45", "Hi <tool_call>get_wea", "Hi <tool_call>get_wea", []),
    ("glm45", '<tool_call>\n{"name": "x"}\n</tool_call>', '<tool_call>\n{"name": "x"}\n</tool_call>', []),
    (
        "mistral",
        'Both. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}, '
        '{"name": "write_file", "arguments": "{\\"path\\": \\"a\\"}"}]',
        "Both. ",
        [("get_weather", {"city": "Paris"}), ("write_file", {"path": "a"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_weather[CALL_ID]xyzXYZ789'
        '[ARGS]{"city": "Bern"} and text',
        "and text",
        [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Bern"})],
    ),
    ('mistral', '[TOOL_CALLS]get_weather{"city": "Rome"}', "", [("get_weather", {"city": "Rome"})]),
    ("mistral", "[TOOL_CALLS] hello there", "[TOOL_CALLS] hello there", []),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]Paris", "[TOOL_CALLS]get_weather[ARGS]Paris", []),
    ("mistral", '[TOOL_CALLS] [{"arguments": {}}] x', '[TOOL_CALLS] [{"arguments": {}}] x', []),
    ("mistral", "[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea", []),
    # an array left open ends at the end of the output
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"days": 1}},', "", [("get_weather", {"days": 1})]),
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "write_file", "arguments": {"path": "a", "content": "x]"}}]',
        "",
        [("get_weather", {"city": "Paris", "days": 3}), ("write_file", {"path": "a", "content": "x]"})],
    ),
    # text before the list is text; Granite 3.1's <tool_call> before a list; a list left open
    ("granite", 'Sure.\n<tool_call> [{"name": "get_weather", "parameters": {"city": "Oslo"}}]', "Sure.\n",
     [("get_weather", {"city": "Oslo"})]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"days": 1}}, ', "", [("get_weather", {"days": 1})]),
    # an opener with no list after it (Granite 3.1's hermes-like <tool_call>{...}) stays text
    ("granite", '<tool_call>{"name": "get_weather"}', '<tool_call>{"name": "get_weather"}', []),
    ("granite", "<|tool_call|>hello", "<|tool_call|>hello", []),
    (
        "phi4_mini_json",
        'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "configure", '
        '"arguments": {"tags": ["x", "y"], "opts": {"a": [1]}}}] Done.',
        "Done.",
        [("get_weather", {"city": "Paris"}), ("configure", {"tags": ["x", "y"], "opts": {"a": [1]}})],
    ),
    ("phi4_mini_json", "I used functools.partial here.", "I used functools.partial here.", []),
    ("phi4_mini_json", 'functools [{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}]', "",
     [("get_weather", {"city": "Rome"})]),
    ("phi4_mini_json", "See functools", "See functools", []),
    ("phi4_mini_json", "functools[1, 2]", "functools[1, 2]", []),
]


@pytest.mark.parametrize("fmt,text,normal,calls", SCRIPTED)
def test_scripted(fmt, text, normal, calls):
    assert_all_paths(fmt, text, normal, calls, [text[i : i + 3] for i in range(0, len(text), 3)])


HEAD = '<tool_call>\n{"name": "get_weather", '
HARMONY_HEAD = "<|channel|>commentary to=functions.get_weather<|message|>"


@pytest.mark.parametrize("fmt,text,arguments", [
    ("hermes", HEAD + '"arguments": {"city": "Paris", "days": 3', '{"city": "Paris", "days": 3'),
    ("hermes", HEAD + '"arguments": {"city": "Par', '{"city": "Par'),
    ("hermes", HEAD + '"arguments": {', "{"),
    ("hermes", HEAD + '"argu', ""),
    ("hermes", HEAD + '"arguments": {"city": "Nice"}', '{"city": "Nice"}'),
    # members complete before the cut are written as every call's arguments are
    ("hermes", HEAD + '"arguments": {"city":"Nice","da', '{"city": "Nice","da'),
    ("gpt_oss", HARMONY_HEAD + '{"city": "Os', '{"city": "Os'),
    ("gpt_oss", HARMONY_HEAD, ""),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', '{"city": "Par'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice", "da',
     '{"city": "Nice", "da'),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Par', '{"city": "Par'),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"days": 2, "ci', '{"days": 2, "ci'),
])
def test_a_call_cut_short_keeps_its_arguments_as_far_as_they_came(fmt, text, arguments):
    expected = ("", [("get_weather", arguments)])
    assert non_stream(fmt, text) == expected
    assert run_stream(fmt, list(text))[:2] == expected


def test_harmony_non_json_body_is_passed_on_raw():
    text = "<|channel|>commentary to=functions.get_weather<|message|>Oslo please<|call|>"
    assert non_stream("gpt_oss", text) == ("", [("get_weather", "Oslo please")])
    assert run_stream("gpt_oss", list(text))[:2] == ("", [("get_weather", "Oslo please")])


def test_items_stream_incrementally():
    text = ("<tool_call>\n<function=write_file>\n<parameter=content>\n" + "line\n" * 5
            + "</parameter>\n<parameter=path>\nx.txt\n</parameter>\n</function>\n</tool_call>")
    _, calls, items = run_stream("qwen3_coder", list(text))
    assert items[0] == ToolCallItem(0, "write_file", "")
    assert all(i.name is None and i.parameters for i in items[1:])
    assert len(items) > 20, "a string value streams as it arrives"
    assert calls == [("write_file", json.dumps({"content": "line\n" * 4 + "line", "path": "x.txt"}))]
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    _, _, items = run_stream("hermes", list(hermes))
    assert [i.parameters for i in items] == ["", "{", '"city": "Paris"', ', "days": 3}']


def test_opener_split_across_chunks_is_held():
    parser = tool_parser("hermes")
    r = parser.feed_text("Let me check <tool_")
    assert (r.content, r.calls) == ("Let me check ", [])
    r = parser.feed_text('call>\n{"name": "get_weather", ')
    assert r.content == "" and r.calls == [ToolCallItem(0, "get_weather", "")]
    parser = tool_parser("hermes")
    r = parser.feed_text("a <b")
    assert (r.content, r.calls) == ("a <b", [])


@pytest.mark.parametrize("raw,schema,expected", [
    ("5", {"type": "integer"}, 5),
    (" 5 ", {"type": "integer"}, 5),
    ("five", {"type": "integer"}, "five"),
    ("2.5", {"type": "number"}, 2.5),
    ("3", {"type": "number"}, 3),
    ("TRUE", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False),
    ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
    ("{'a': True, 'b': None}", {"type": "object"}, {"a": True, "b": None}),
    ("[1, 'x']", {"type": "array"}, [1, "x"]),
    ("null", {"type": "integer"}, None),
    ("null", {"type": ["string", "null"]}, None),
    ("null", {"type": "string"}, "null"),
    ("7", None, "7"),
    ("7", {"description": "no type"}, "7"),
    ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
    ("x7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x7"),
    ("  keep spaces ", {"type": "string"}, "  keep spaces "),
])
def test_convert_param_value(raw, schema, expected):
    got = convert_param_value(raw, schema)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("raw,schema,expected", [
    ("5", {"type": "string"}, "5"),
    ("5", {"type": "integer"}, 5),
    ("5", None, 5),
    ("true", {"type": "boolean"}, True),
    ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
    ('{\\"a\\": 1}', {"type": "object"}, {"a": 1}),
    ("{'a': None}", {"type": "object"}, {"a": None}),
    ("null", {"type": ["string", "null"]}, None),
    ("Paris", {"type": ["string", "null"]}, "Paris"),
    ("not json", {"type": "integer"}, "not json"),
])
def test_glm_value(raw, schema, expected):
    got = glm_value(raw, schema)
    assert got == expected and type(got) is type(expected)


def test_mistral_call_ids_are_nine_alphanumerics():
    ids = {registry.call_id("mistral") for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)
    assert registry.call_id("hermes").startswith("call_") and registry.call_id(None).startswith("call_")


def test_typed_values_through_qwen3_coder():
    params = {"ratio": "0.25", "opts": "{'deep': {'x': 1}}", "tags": '["a", "b"]', "limit": "null", "note": "null"}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    text = f"<tool_call>\n<function=configure>\n{body}</function>\n</tool_call>"
    expected = {"ratio": 0.25, "opts": {"deep": {"x": 1}}, "tags": ["a", "b"], "limit": None, "note": None}
    assert_all_paths("qwen3_coder", text, "", [("configure", expected)])


def test_reasoning_then_tools_pipeline_streams_like_one_shot():
    cases = [
        ("qwen3", True, "qwen3_coder",
         "I need the weather.\n</think>\n\nOne moment.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
         "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
         "</parameter>\n</function>\n</tool_call>",
         "I need the weather.", "One moment.\n", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
        ("qwen3", True, "hermes", "Call it directly.\n" + render_call("hermes", "get_weather", {"city": "Lyon"}),
         "Call it directly.", "", [("get_weather", {"city": "Lyon"})]),
        ("gpt_oss", False, "gpt_oss",
         "<|channel|>analysis<|message|>Need two calls.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
         " <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|><|start|>assistant<|channel|>commentary "
         "to=functions.get_weather<|message|>{\"city\": \"Bergen\"}<|start|>assistant<|channel|>final<|message|>Done.<|return|>",
         "Need two calls.", "Done.", [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]),
    ]
    for rp_name, force, tp_name, text, reasoning, normal, calls in cases:
        one = registry.parse_text(text, reasoning=rp_name, force_reasoning=force)
        r_one, c_one = one.reasoning, one.content
        assert r_one == reasoning
        assert_all_paths(tp_name, c_one, normal, calls)
        both = registry.output_parser(rp_name, tp_name, TOOLS, force)
        out = [both.feed_text(ch) for ch in text] + [both.finish()]
        assert "".join(o.reasoning for o in out) == reasoning
        assert "".join(o.content for o in out) == normal
        names = [i.name for o in out for i in o.calls if i.name]
        assert names == [n for n, _ in calls]
        whole = registry.parse_text(text, rp_name, tp_name, TOOLS, force)
        assert (whole.reasoning, whole.content) == (reasoning, normal)
        assert [(c.name, json.loads(c.parameters)) for c in whole.calls] == calls


def detector(parser_name: str) -> type[Detector]:
    family = registry.tool_family(parser_name)
    assert family is not None and family.detector is not None
    return family.detector  # type: ignore[return-value]


def has_tool_call(parser_name: str, text: str) -> bool:
    return detector(parser_name)(TOOLS).find_start(text) >= 0


def test_has_tool_call_and_registry():
    assert has_tool_call("hermes", "x <tool_call>")
    assert not has_tool_call("hermes", "<function=f>")
    assert has_tool_call("qwen3_coder", "<function=f>")
    assert has_tool_call("gpt_oss", "<|channel|>commentary to=functions.f")
    assert has_tool_call("mistral", "x [TOOL_CALLS]")
    assert has_tool_call("granite", "<|tool_call|>[") and has_tool_call("phi4_mini_json", "x functools[")
    assert {"hermes", "qwen25", "qwen", "qwen3_coder", "gpt_oss", "glm45", "mistral", "granite",
            "phi4_mini_json"} == set(registry.TOOL_CALL_PARSERS)
    assert detector("qwen") is HermesDetector
    assert detector("qwen3_coder") is Qwen3CoderDetector
    assert detector("gpt_oss") is HarmonyDetector
    assert detector("glm45") is Glm45Detector and detector("mistral") is MistralDetector
    assert detector("granite") is GraniteDetector and detector("phi4_mini_json") is Phi4MiniDetector
    assert all(issubclass(detector(n), Detector) for n in registry.TOOL_CALL_PARSERS)
    tags = {m for n in registry.TOOL_CALL_PARSERS for m in detector(n).start_markers}
    assert {"<tool_call>", "<function=", "<|channel|>", "<|start|>", "[TOOL_CALLS]", "<|tool_call|>",
            "functools"} == tags
    with pytest.raises(ValueError):
        tool_parser("auto")


def test_parse_non_stream_leaves_stream_state_alone():
    parser = tool_parser("hermes")
    assert parser.feed_text("Hello <tool_").content == "Hello "
    assert registry.parse_text("plain", tool="hermes", tools=TOOLS).content == "plain"
    assert parser.feed_text("x").content == "<tool_x"
