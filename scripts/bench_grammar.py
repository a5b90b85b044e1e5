"""Grammar engines on this CPU: llguidance (ours) against xgrammar, on the default model's vocab.

For three JSON schemas (small, medium, large) it measures
  compile: the grammar built from the schema, fresh (xgrammar's cache is off). llguidance
           compiles lazily, so its first mask is timed too: "ready" is compile + first mask;
  mask:    32 matchers in lockstep over valid outputs of the schema (8 different instances,
           tokenized by the model's tokenizer), the batched mask fill per step (llguidance's
           LLExecutor, xgrammar's BatchGrammarMatcher), and the per-token advance.
The tokenizers' set-up (each walks the vocabulary once per model) is timed apart.

xgrammar is not a dependency: install it aside and point the script at it, e.g.
    pip install --no-deps --target /tmp/xg xgrammar==0.2.8 apache-tvm-ffi
    python scripts/bench_grammar.py --xgrammar-path /tmp/xg
Without --xgrammar-path (or if it does not import) llguidance is measured alone.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402

SMALL = {"type": "object", "required": ["name", "age"],
         "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
MEDIUM = {"type": "object", "required": ["id", "title", "tags", "price", "stock", "status"],
          "properties": {"id": {"type": "integer", "minimum": 0},
                         "title": {"type": "string", "maxLength": 60},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                         "price": {"type": "number"},
                         "stock": {"type": "object", "required": ["warehouse", "count"],
                                   "properties": {"warehouse": {"enum": ["north", "south", "east"]},
                                                  "count": {"type": "integer"}}},
                         "status": {"enum": ["draft", "active", "archived"]}}}
ADDRESS = {"type": "object", "required": ["street", "city", "zip", "country"],
           "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                          "country": {"enum": ["FR", "DE", "US", "JP", "BR"]}}}
LARGE = {"type": "object", "$defs": {"address": ADDRESS},
         "required": ["customer", "orders", "billing", "shipping", "notes", "flags"],
         "properties": {
             "customer": {"type": "object", "required": ["first", "last", "email", "phone"],
                          "properties": {"first": {"type": "string"}, "last": {"type": "string"},
                                         "email": {"type": "string", "format": "email"},
                                         "phone": {"type": "string",
                                                   "pattern": "^\\+?[0-9 ]{7,15}$"}}},
             "orders": {"type": "array", "items": {
                 "type": "object", "required": ["sku", "qty", "unit_price", "discount"],
                 "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                "unit_price": {"type": "number"},
                                "discount": {"anyOf": [{"type": "null"}, {"type": "number"}]}}}},
             "billing": {"$ref": "#/$defs/address"},
             "shipping": {"$ref": "#/$defs/address"},
             "notes": {"type": "string", "maxLength": 200},
             "flags": {"type": "object", "additionalProperties": {"type": "boolean"}}}}


def instances(name: str, n: int) -> list[Any]:
    """`n` different valid values of schema `name`."""
    out = []
    for i in range(n):
        if name == "small":
            out.append({"name": f"Ada Lovelace {i}", "age": 36 + i})
        elif name == "medium":
            out.append({"id": 1000 + i, "title": f"Blue ceramic mug, {i} pack",
                        "tags": ["kitchen", "gift", f"set-{i}"], "price": 12.5 + i,
                        "stock": {"warehouse": ["north", "south", "east"][i % 3], "count": 7 * i},
                        "status": ["draft", "active", "archived"][i % 3]})
        else:
            address = {"street": f"{i} rue de la Paix", "city": "Paris", "zip": f"7500{i % 10}",
                       "country": "FR"}
            customer = {"first": "Grace", "last": f"Hopper{i}", "email": f"grace{i}@example.com",
                        "phone": f"+33 1 23 45 6{i}"}
            out.append({"customer": customer,
                        "orders": [{"sku": f"ABC-{1000 + j}", "qty": j + 1, "unit_price": 3.25 * j,
                                    "discount": None if j % 2 else 0.1} for j in range(3 + i % 3)],
                        "billing": address, "shipping": copy.deepcopy(address),
                        "notes": f"Leave it at the door, parcel {i}.",
                        "flags": {"gift": i % 2 == 0, "express": True}})
    return out


SCHEMAS = {"small": SMALL, "medium": MEDIUM, "large": LARGE}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, eos: list[int]):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.setup_s, self.tokenizer = timed(lambda: llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=eos))
        self.vocab_size, self.executor = vocab_size, llguidance.LLExecutor()

    def compile(self, schema: dict) -> tuple[float, float, Any]:
        """(compile s, first mask s, compiled)."""
        grammar = self.ll.grammar_from("json_schema", json.dumps(schema))
        t_compile, matcher = timed(lambda: self.ll.LLMatcher(self.tokenizer, grammar))
        assert not matcher.is_error(), matcher.get_error()
        bitmask = self.llt.allocate_token_bitmask(1, self.vocab_size)
        t_mask, _ = timed(lambda: self.llt.fill_next_token_bitmask(matcher, bitmask, 0))
        return t_compile, t_mask, grammar

    def matchers(self, compiled, n: int) -> list[Any]:
        return [self.ll.LLMatcher(self.tokenizer, compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.llt.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor,
                                             [(m, i) for i, m in enumerate(matchers)], bitmask)

    def advance(self, matchers: list[Any], tokens: list[int]) -> None:
        for m, t in zip(matchers, tokens):
            assert m.consume_token(t), m.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int, eos: list[int]):
        import xgrammar

        self.xgr = xgrammar
        self.setup_s, self.info = timed(lambda: xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos))
        self.vocab_size = vocab_size
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict) -> tuple[float, float, Any]:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        t_compile, compiled = timed(lambda: compiler.compile_json_schema(json.dumps(schema)))
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        t_mask, _ = timed(lambda: matcher.fill_next_token_bitmask(bitmask, 0))
        return t_compile, t_mask, compiled

    def matchers(self, compiled, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(self, matchers: list[Any], tokens: list[int]) -> None:
        for m, t in zip(matchers, tokens):
            assert m.accept_token(t)


def lockstep(engine, compiled, sequences: list[list[int]]) -> tuple[float, float, int]:
    """(mask s per step, advance s per step, steps) of len(sequences) matchers in lockstep."""
    matchers = engine.matchers(compiled, len(sequences))
    bitmask = engine.bitmask(len(sequences))
    steps = min(len(s) for s in sequences)
    t_mask = t_advance = 0.0
    for i in range(steps):
        t0 = time.perf_counter()
        engine.fill(matchers, bitmask)
        t1 = time.perf_counter()
        engine.advance(matchers, [s[i] for s in sequences])
        t_mask, t_advance = t_mask + t1 - t0, t_advance + time.perf_counter() - t1
    return t_mask / steps, t_advance / steps, steps


def load_xgrammar(path: str | None) -> str | None:
    """None when xgrammar imports (from `path`), else why not."""
    if path is None:
        return "no --xgrammar-path"
    sys.path.insert(0, path)
    try:
        import xgrammar  # noqa: F401
    except Exception as exc:  # a missing native piece shows up as any error
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> None:
    p = bc.base_parser(__doc__.split("\n")[0])
    p.add_argument("--xgrammar-path", default=None,
                   help="folder holding xgrammar and apache-tvm-ffi (pip install --target)")
    p.add_argument("--batch", type=int, default=32, help="matchers in lockstep")
    args = p.parse_args()
    bc.setup(args)
    from freetoken.models.registry import load_model

    loaded = load_model(None, dtype="float32", device="cpu")
    tok, vocab, eos = loaded.tokenizer, loaded.vocab_size, list(loaded.eos_token_ids)
    engines: list[Any] = [LLGuidance(tok, vocab, eos)]
    missing = load_xgrammar(args.xgrammar_path)
    if missing is None:
        engines.append(XGrammar(tok, vocab, eos))
    else:
        bc.note(f"# xgrammar not measured: {missing}")

    bc.print_table("Tokenizer set-up (once per model)", ["engine", "ms"],
                   [[e.name, bc.ms(e.setup_s)] for e in engines])
    compile_rows, mask_rows = [], []
    for name, schema in SCHEMAS.items():
        values = instances(name, 8)
        sequences = [tok.encode(json.dumps(values[i % len(values)]), add_special_tokens=False)
                     for i in range(args.batch)]
        for engine in engines:
            runs = [engine.compile(schema) for _ in range(args.repeats)]
            t_compile = min(r[0] for r in runs)
            t_first = min(r[1] for r in runs)
            compile_rows.append([name, engine.name] + [f"{t * 1e3:,.2f}" for t in (
                t_compile, t_first, t_compile + t_first)])
            best = min(lockstep(engine, runs[0][2], sequences) for _ in range(args.repeats))
            t_mask, t_advance, steps = best
            mask_rows.append([name, engine.name, steps, f"{t_mask * 1e6:,.0f}",
                              f"{t_mask * 1e6 / args.batch:,.1f}", f"{t_advance * 1e6:,.0f}"])
    bc.print_table("Compile, fresh (ms; ready = compile + first mask)",
                   ["schema", "engine", "compile", "first mask", "ready"], compile_rows)
    bc.print_table(f"Masks at batch {args.batch}, in lockstep over valid outputs (µs per step)",
                   ["schema", "engine", "steps", "mask/step", "per row", "advance/step"], mask_rows)
    bc.load_note()


if __name__ == "__main__":
    main()
