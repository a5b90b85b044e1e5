"""Structured outputs at the HTTP edge: a request's `response_format`, `structured_outputs` and
`guided_*` fields as one `StructuredSpec` (pure, run as the request is parsed), and the
llguidance check that makes a bad schema, regex or grammar a 400 before anything runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Mapping

from freetoken.core import StructuredSpec
from freetoken.serving.errors import RequestError
from freetoken.structured import grammar

log = logging.getLogger("freetoken")

# In this order: with two of them set, the second is named in the 400.
SPEC_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar")
# Every field read here: the spec fields and the options that shape them.
FIELDS = (*SPEC_FIELDS, "guided_decoding_backend", "guided_whitespace_pattern")
# vLLM's backend names are all served by llguidance: each of them guarantees the output matches
# the grammar, which is what a client asks for (only whitespace choices may differ).
BACKENDS = ("auto", "llguidance", "guidance", "xgrammar", "outlines", "lm-format-enforcer")
# JSON whitespace where the request says nothing: up to 16 characters per gap, enough for any
# indentation, and no more, since a weak model may fill unbounded whitespace until max_tokens.
DEFAULT_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_SO_OPTIONS = ("whitespace_pattern", "disable_any_whitespace", "disable_fallback",
               "disable_additional_properties")


@dataclass(frozen=True)
class Requested:
    spec: StructuredSpec
    field: str  # the request field it came from, named in a 400


def _fail(message: str, param: str) -> RequestError:
    return RequestError(message, param=param)


def _json_spec(schema: Any, param: str, whitespace: str | None, compact: bool) -> StructuredSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise _fail(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict):
        raise _fail(f"{param} must be a JSON schema object", param)
    guidance = schema.get("x-guidance")
    own = isinstance(guidance, dict) and guidance.keys() & {"whitespace_pattern",
                                                            "whitespace_flexible"}
    layout = ({"whitespace_pattern": whitespace} if whitespace is not None
              else {"whitespace_flexible": False} if compact
              else {} if own else {"whitespace_pattern": DEFAULT_WHITESPACE})
    if layout:  # llguidance reads its JSON options from the schema's "x-guidance"
        schema = {**schema, "x-guidance": {**(guidance if isinstance(guidance, dict) else {}),
                                           **layout}}
    try:
        return StructuredSpec("json_schema", json.dumps(schema, allow_nan=False))
    except (ValueError, TypeError, RecursionError) as exc:
        raise _fail(f"{param} is not a valid JSON schema: {exc}", param) from None


def _whitespace(value: Any, param: str) -> str:
    """A whitespace regex, compiled here so that a bad one is named as itself (llguidance only
    meets it inside the schema; compiling a regex alone is cheap and needs no tokenizer)."""
    if not isinstance(value, str):
        raise _fail(f"{param} must be a string (a regex; empty for no whitespace)", param)
    pattern = value
    error = _error(StructuredSpec("regex", pattern), None)
    if error:
        raise _fail(f"Invalid {param}: {error[:500]}", param)
    return pattern


def _text(value: Any, param: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(f"{param} must be a non-empty string ({what})", param)
    return value


def _choice(value: Any, param: str) -> StructuredSpec:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise _fail(f"{param} must be a non-empty list of strings", param)
    return StructuredSpec("choice", json.dumps(value))


def _response_format(value: Any, whitespace: str | None) -> StructuredSpec | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise _fail("response_format must be an object with a type", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_spec({"type": "object"}, param, whitespace, False)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _fail("response_format json_schema needs json_schema.schema", param)
        if not isinstance(spec.get("name", ""), str):
            raise _fail("response_format json_schema.name must be a string", param)
        if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
            raise _fail("response_format json_schema.strict must be a boolean", param)
        return _json_spec(spec["schema"], param, whitespace, False)
    raise _fail("response_format.type must be 'text', 'json_object' or 'json_schema'; "
                f"{str(kind)[:40]!r} is not supported", param)


def _structured_outputs(value: Any, whitespace: str | None) -> StructuredSpec:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise _fail("structured_outputs must be an object", param)
    unknown = sorted(str(k) for k in value if k not in _SO_KINDS + _SO_OPTIONS)
    if unknown:
        raise _fail(f"structured_outputs.{unknown[0][:40]} is not supported", param)
    kinds = [k for k in _SO_KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(kinds) != 1:
        raise _fail("structured_outputs must hold exactly one of json, regex, choice, grammar "
                    f"and json_object; it holds {len(kinds)}", param)
    if value.get("disable_additional_properties"):
        raise _fail("structured_outputs.disable_additional_properties is not supported", param)
    for flag in ("disable_any_whitespace", "disable_fallback"):
        if not isinstance(value.get(flag, False), bool):
            raise _fail(f"structured_outputs.{flag} must be a boolean", param)
    guided, own = whitespace is not None, value.get("whitespace_pattern")
    if own is not None:
        if whitespace is not None:
            raise _fail("structured_outputs.whitespace_pattern and guided_whitespace_pattern "
                        "cannot both be set", "guided_whitespace_pattern")
        whitespace = _whitespace(own, param)
    compact = bool(value.get("disable_any_whitespace"))
    [kind] = kinds
    if kind == "structural_tag":
        raise _fail("structured_outputs.structural_tag is not supported", param)
    if kind in ("json", "json_object"):
        if kind == "json_object" and value[kind] is not True:
            raise _fail("structured_outputs.json_object must be true", param)
        schema = value[kind] if kind == "json" else {"type": "object"}
        return _json_spec(schema, param, whitespace, compact)
    if whitespace is not None or compact:
        raise _fail("whitespace options only apply to JSON structured outputs",
                    "guided_whitespace_pattern" if guided else param)
    if kind == "choice":
        return _choice(value[kind], param)
    return StructuredSpec(kind, _text(value[kind], param, f"the {kind}"))


def requested(fields: Mapping[str, Any]) -> Requested | None:
    """The structured output a request's `FIELDS` ask for, checked for shape (pure); None for
    free output. Raises `RequestError` naming the field. Whether llguidance compiles it is
    `check`'s."""
    fields = {name: fields.get(name) for name in FIELDS}
    backend = fields["guided_decoding_backend"]
    if backend is not None and backend not in BACKENDS:
        raise _fail(f"guided_decoding_backend must be one of {', '.join(BACKENDS)} (all served "
                    "by llguidance)", "guided_decoding_backend")
    whitespace = fields["guided_whitespace_pattern"]
    if whitespace is not None:
        whitespace = _whitespace(whitespace, "guided_whitespace_pattern")
    found: list[Requested] = []
    for name in SPEC_FIELDS:
        value = fields[name]
        if value is None or (name == "response_format" and value == {"type": "text"}):
            continue
        if found:
            raise _fail(f"{name} cannot be combined with {found[0].field}: a request takes one "
                        "structured output", name)
        if name == "response_format":
            spec = _response_format(value, whitespace)
        elif name == "structured_outputs":
            spec = _structured_outputs(value, whitespace)
        elif name == "guided_json":
            spec = _json_spec(value, name, whitespace, False)
        elif name == "guided_choice":
            spec = _choice(value, name)
        else:
            kind = "regex" if name == "guided_regex" else "grammar"
            spec = StructuredSpec(kind, _text(value, name, f"a {kind}"))
        if spec is not None:
            found.append(Requested(spec, name))
    if whitespace is not None and (not found or found[0].spec.kind != "json_schema"):
        raise _fail("guided_whitespace_pattern only applies to JSON structured outputs",
                    "guided_whitespace_pattern")
    return found[0] if found else None


_BUILD = threading.Lock()  # one llguidance tokenizer per process (it walks the whole vocabulary)
_UNREADABLE: set[int] = set()  # ids of tokenizers llguidance could not read (warned once)


def _ll_tokenizer(state: Any) -> Any:
    """llguidance's view of the vocabulary, which also checks a grammar's token names; None
    (grammar checks only) for a state without a tokenizer, or a tokenizer llguidance cannot
    read (the engine then reports what does not compile)."""
    tokenizer = getattr(state, "tokenizer", None)
    if tokenizer is None or id(tokenizer) in _UNREADABLE:
        return None
    with _BUILD:
        try:
            # The tokenizer's own EOS: which ids end the output does not change what compiles.
            return grammar.ll_tokenizer(tokenizer, state.config.vocab_size)
        except Exception:
            _UNREADABLE.add(id(tokenizer))
            log.warning("llguidance cannot read this tokenizer; grammars are checked without it",
                        exc_info=True)
            return None


@lru_cache(maxsize=1024)
def _error(spec: StructuredSpec, tokenizer: Any) -> str | None:
    try:
        return grammar.validate(spec, tokenizer)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a Rust panic is a BaseException; the request is at fault
        return str(exc) or type(exc).__name__


async def check(state: Any, spec: StructuredSpec | None, param: str | None) -> None:
    """A 400 naming `param` unless `spec` compiles (checked in a worker thread: building the
    llguidance tokenizer, once, and compiling a grammar may take seconds; results cached)."""
    if spec is None:
        return
    key = replace(spec, after_ids=())
    error = await asyncio.to_thread(lambda: _error(key, _ll_tokenizer(state)))
    if error:
        raise _fail(f"Invalid {param}: {error[:1000]}", param or "tools")
