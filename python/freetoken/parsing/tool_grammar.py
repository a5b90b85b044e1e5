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


# The tags that end a qwen3_coder parameter value (Qwen3CoderDetector's value ends).
_VALUE_ENDS = ("</parameter>", "<parameter=", "</function>", "</tool_call>")
_ENDS = "|".join(re.escape(t).replace("/", "\\/") for t in _VALUE_ENDS)
_NO_TAG = f"~/(?s:.*)({_ENDS})(?s:.*)/"


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


def _coder_value(schema: Any, term: str, rules: list[str]) -> str:
    """One value and its closing tag, as the qwen3_coder parser types it: a string (or untyped)
    value is raw text, anything else JSON. Adds the terminals it needs to `rules`."""
    end = quote("\n</parameter>\n")
    if isinstance(schema, dict) and ("enum" in schema or "const" in schema):
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if isinstance(values, list) and values:
            return "(" + " | ".join(quote(_raw(v)) for v in values) + ") " + end
    types = _types(schema)
    if types and "string" not in types:
        return f"{_json(schema)} {end}"
    low, high = 0, None
    if isinstance(schema, dict):
        low = schema["minLength"] if type(schema.get("minLength")) is int else 0
        high = schema["maxLength"] if type(schema.get("maxLength")) is int else None
    text = f"/(?s:.){{{low},{'' if high is None else high}}}/ & {_NO_TAG}"
    if isinstance(schema, dict) and isinstance(schema.get("pattern"), str):
        text += " & " + _regex(schema["pattern"].removeprefix("^").removesuffix("$"))
    # The closing tag is part of the terminal: a lexeme is greedy, and text alone would run
    # on into "\n</parameter" and then have no way to end.
    rules += [f"{term}_TEXT: {text}", f"{term}: {term}_TEXT {end}"]
    return term


def qwen3_coder(tools: list[dict], name: str | None, parallel: bool, literal: Literal) -> str:
    """``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...``
    ``</function>\\n</tool_call>``: the parameters in the schema's order, the required ones
    always; string values are text without the closing tags, typed ones JSON."""
    chosen = _chosen(tools, name)
    rules = [_start(parallel and name is None), _alternatives(chosen)]
    open_, close = literal("<tool_call>"), literal("</tool_call>")
    end_call = quote("</function>\n")
    for i, tool in enumerate(chosen):
        schema = _params(tool)
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [r for r in schema.get("required") or [] if isinstance(r, str)]
        props = {**props, **{r: {"type": "string"} for r in required if r not in props}}
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        parts = []
        for j, (key, sub) in enumerate(props.items()):
            sub = {**sub, **defs} if isinstance(sub, dict) and defs else sub
            value = _coder_value(sub, f"V_{i}_{j}", rules)
            part = f"{quote(f'<parameter={key}>' + NL)} {value}"
            parts.append(f"({part})" if key in required else f"({part})?")
        head = quote(f"\n<function={tool['function']['name']}>\n")
        rules.append(f"call_{i}: {open_} {head} {' '.join(parts)} {end_call} {close}")
    return "\n".join(rules) + "\n"


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
