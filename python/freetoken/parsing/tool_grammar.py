"""Grammars (llguidance's Lark dialect) that make a reply tool calls in a tool parser's own
format: tool_choice "required" (one call or more, of any tool) and a named choice (exactly one
call of that tool). Each call's arguments obey its tool's `parameters` schema, so what the
parser reads back validates against it.

Every builder takes `literal(marker)`: how a format marker is written in the grammar. A marker
that the vocabulary holds as one added token must be `<[id]>`, since llguidance never matches an
added token by its text; anything else is a quoted string (`quote`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from freetoken.parsing.family import single_id

Literal = Callable[[str], str]
NL = "\n"

# Calls' JSON as the chat templates write it (json.dumps's separators), with no free whitespace:
# a weak model may fill free whitespace forever. Harmony's models write it tight or spaced.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ONE_SPACE = {"whitespace_pattern": " ?"}
_NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}


def quote(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


def _params(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else _NO_ARGS


def _json(schema: Any, layout: dict = COMPACT) -> str:
    """An inline JSON schema (refs such as `#/$defs/...` resolve against it, as in the tool)."""
    return "%json " + json.dumps({**schema, "x-guidance": layout})


def _chosen(tools: list[dict], name: str | None) -> list[dict]:
    return [t for t in tools if name is None or t["function"]["name"] == name]


def _start(many: bool) -> str:
    """One call, or with `many` one or more joined by a newline."""
    return 'start: call ("\\n" call)*' if many else "start: call"


def _alternatives(chosen: list[dict]) -> str:
    return "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))


def hermes(tools: list[dict], name: str | None, parallel: bool, literal: Literal) -> str:
    """``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``, calls joined by a
    newline. The name is literal text before the JSON arguments, so each tool's alternative is
    told apart before its schema starts."""
    chosen = _chosen(tools, name)
    rules = [_start(parallel and name is None), _alternatives(chosen)]
    open_, close, tail = literal("<tool_call>"), literal("</tool_call>"), quote("}\n")
    for i, tool in enumerate(chosen):
        head = quote('\n{"name": ' + json.dumps(tool["function"]["name"]) + ', "arguments": ')
        rules.append(f"call_{i}: {open_} {head} {_json(_params(tool))} {tail} {close}")
    return "\n".join(rules) + "\n"


def _no_tag(tags: tuple[str, ...]) -> str:
    """A regex of text that holds none of `tags`."""
    ends = "|".join(re.escape(t).replace("/", "\\/") for t in tags)
    return f"~/(?s:.*)({ends})(?s:.*)/"


# The tags that end a parameter value in qwen3_coder and glm45 (their detectors' value ends).
_CODER_TAGS = _no_tag(("</parameter>", "<parameter=", "</function>", "</tool_call>"))
_GLM_TAGS = _no_tag(("</arg_value>", "<arg_key>", "</tool_call>"))


def _types(schema: Any) -> set[str]:
    """Declared types, anyOf/oneOf included (as the parser reads them)."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else set(declared or []) if isinstance(
        declared, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= _types(sub)
    return types


def _raw(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _regex(text: str) -> str:
    return "/" + text.replace("/", "\\/") + "/"


def _tagged_value(schema: Any, term: str, rules: list[str], end: str, no_tag: str, as_text: bool,
                  trimmed: bool = False) -> str:
    """One value and its closing tag `end`: raw text without the tags of `no_tag` when
    `as_text` (with `trimmed`, neither starting nor ending with whitespace), else JSON; an enum
    is its values' raw texts. Adds the terminals it needs to `rules`."""
    if isinstance(schema, dict) and ("enum" in schema or "const" in schema):
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if isinstance(values, list) and values:
            return "(" + " | ".join(quote(_raw(v)) for v in values) + ") " + end
    if not as_text:
        return f"{_json(schema)} {end}"
    low, high = 0, None
    if isinstance(schema, dict):
        low = schema["minLength"] if type(schema.get("minLength")) is int else 0
        high = schema["maxLength"] if type(schema.get("maxLength")) is int else None
    text = f"/(?s:.){{{low},{'' if high is None else high}}}/ & {no_tag}"
    if trimmed:
        text += " & /(?s:(\\S(.*\\S)?)?)/"
    if isinstance(schema, dict) and isinstance(schema.get("pattern"), str):
        text += " & " + _regex(schema["pattern"].removeprefix("^").removesuffix("$"))
    # A closing tag of plain text is part of the terminal: a lexeme is greedy, and text alone
    # would run on into "\n</parameter" and then have no way to end. A tag that is one added
    # token ends the text by itself, and cannot be part of a terminal.
    head = term.lower() if "<[" in end else term
    rules += [f"{term}_TEXT: {text}", f"{head}: {term}_TEXT {end}"]
    return head


def _coder_value(schema: Any, term: str, rules: list[str]) -> str:
    """A qwen3_coder value: a string (or untyped) value is raw text, anything else JSON."""
    types = _types(schema)
    return _tagged_value(schema, term, rules, quote("\n</parameter>\n"), _CODER_TAGS,
                         as_text=not types or "string" in types)


def _members(tool: dict, member: Callable[[int, str, Any], str]) -> str:
    """The tool's parameters in the schema's order, each as `member(j, key, schema)`: the
    required ones always (a string where the schema leaves one undeclared), the others
    optional; the schema's `$defs` go with each sub-schema."""
    schema = _params(tool)
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = [r for r in schema.get("required") or [] if isinstance(r, str)]
    props = {**props, **{r: {"type": "string"} for r in required if r not in props}}
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parts = []
    for j, (key, sub) in enumerate(props.items()):
        part = member(j, key, {**sub, **defs} if isinstance(sub, dict) and defs else sub)
        parts.append(f"({part})" if key in required else f"({part})?")
    return " ".join(parts)


def qwen3_coder(tools: list[dict], name: str | None, parallel: bool, literal: Literal) -> str:
    """``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...``
    ``</function>\\n</tool_call>``: the parameters in the schema's order, the required ones
    always; string values are text without the closing tags, typed ones JSON."""
    chosen = _chosen(tools, name)
    rules = [_start(parallel and name is None), _alternatives(chosen)]
    open_, close = literal("<tool_call>"), literal("</tool_call>")
    end_call = quote("</function>\n")
    for i, tool in enumerate(chosen):
        def member(j: int, key: str, sub: Any) -> str:
            return f"{quote(f'<parameter={key}>' + NL)} {_coder_value(sub, f'V_{i}_{j}', rules)}"

        head = quote(f"\n<function={tool['function']['name']}>\n")
        rules.append(f"call_{i}: {open_} {head} {_members(tool, member)} {end_call} {close}")
    return "\n".join(rules) + "\n"


def glm45(tools: list[dict], name: str | None, parallel: bool, literal: Literal) -> str:
    """``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...``
    ``</tool_call>``: the parameters in the schema's order, the required ones always; a value
    the parser reads as text (its schema only `string`, or untyped) is text without the tags
    or surrounding whitespace, any other JSON."""
    chosen = _chosen(tools, name)
    rules = [_start(parallel and name is None), _alternatives(chosen)]
    key_open, key_end, value = literal("<arg_key>"), literal("</arg_key>"), literal("<arg_value>")
    end = f"{literal('</arg_value>')} {quote(NL)}"
    for i, tool in enumerate(chosen):
        def member(j: int, key: str, sub: Any) -> str:
            v = _tagged_value(sub, f"G_{i}_{j}", rules, end, _GLM_TAGS,
                              as_text=_types(sub) <= {"string"}, trimmed=True)
            return f"{key_open} {quote(key)} {key_end} {quote(NL)} {value} {v}"

        head = quote(f"{tool['function']['name']}{NL}")
        rules.append(f"call_{i}: {literal('<tool_call>')} {head} {_members(tool, member)} "
                     f"{literal('</tool_call>')}")
    return "\n".join(rules) + "\n"


def mistral(tools: list[dict], name: str | None, parallel: bool, literal: Literal) -> str:
    """``[TOOL_CALLS]NAME[ARGS]ARGS`` per call where the vocabulary holds ``[ARGS]`` as a token
    (v11 and later), else ``[TOOL_CALLS] [{"name": NAME, "arguments": ARGS}, ...]`` (v3-v7), as
    the templates write them."""
    chosen = _chosen(tools, name)
    bot, args = literal("[TOOL_CALLS]"), literal("[ARGS]")
    many = parallel and name is None
    if "<[" in args:
        rules = [f"start: call{'+' if many else ''}", _alternatives(chosen)]
        for i, tool in enumerate(chosen):
            rules.append(f"call_{i}: {bot} {quote(tool['function']['name'])} {args} "
                         f"{_json(_params(tool))}")
    else:
        rules = _call_list(chosen, f'{bot} " ["', many)
    return "\n".join(rules) + "\n"


def _call_list(chosen: list[dict], opener: str, many: bool) -> list[str]:
    """`opener` (a grammar expression ending in the list's ``[``), then
    ``{"name": NAME, "arguments": ARGS}``, more after ``, `` with `many`, and ``]``."""
    more = ' (", " call)*' if many else ""
    rules = [f'start: {opener} call{more} "]"', _alternatives(chosen)]
    for i, tool in enumerate(chosen):
        head = quote('{"name": ' + json.dumps(tool["function"]["name"]) + ', "arguments": ')
        rules.append(f"call_{i}: {head} {_json(_params(tool))} \"}}\"")
    return rules


def granite(tools: list[dict], name: str | None, parallel: bool, literal: Literal) -> str:
    """``<|tool_call|>[{"name": NAME, "arguments": ARGS}, ...]``, as Granite 3.x's templates
    ask for its calls."""
    opener = f'{literal("<|tool_call|>")} "["'
    return "\n".join(_call_list(_chosen(tools, name), opener, parallel and name is None)) + "\n"


def phi4_mini(tools: list[dict], name: str | None, parallel: bool, literal: Literal) -> str:
    """``functools[{"name": NAME, "arguments": ARGS}, ...]`` (plain text, no added tokens)."""
    opener = quote("functools[")
    return "\n".join(_call_list(_chosen(tools, name), opener, parallel and name is None)) + "\n"


def harmony(tools: list[dict], name: str | None, parallel: bool, literal: Literal) -> str:
    """``[<|channel|>analysis<|message|>...<|end|><|start|>assistant]<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>ARGS``: Harmony makes one call per turn, and
    its analysis comes first, free. The grammar ends with the arguments; the model's end token
    (``<|call|>``) follows, or ends the output."""
    chosen = _chosen(tools, name)
    ch, msg = literal("<|channel|>"), literal("<|message|>")
    analysis = (f"analysis: {ch} \"analysis\" {msg} THINK {literal('<|end|>')} "
                f"{literal('<|start|>')} \"assistant\"")
    rules = ["start: analysis? call", _alternatives(chosen), analysis, "THINK: /(?s:.*)/"]
    for i, tool in enumerate(chosen):
        head = quote(f"commentary to=functions.{tool['function']['name']} ")
        rules.append(f"call_{i}: {ch} {head} {literal('<|constrain|>')} \"json\" {msg} "
                     f"{_json(_params(tool), ONE_SPACE)}")
    return "\n".join(rules) + "\n"


def token_literal(tokenizer: Any) -> Literal:
    """`literal` for `tokenizer`: `<[id]>` for a marker that is one added token, else quoted."""
    added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())

    def literal(marker: str) -> str:
        token = single_id(tokenizer, marker)
        return f"<[{token}]>" if token is not None and token in added else quote(marker)

    return literal
