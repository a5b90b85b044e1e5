"""ScriptedForCausalLM's logits in closed form, from its config.json alone, and the logprob
entries of a reply compared against it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class ClosedForm:
    """ScriptedForCausalLM's logits, from its config.json numbers only: at a position whose
    scripted token is t, t gets A, each alternative i != t its a_i, every other id the base b."""

    A: float
    alts: dict[int, float]
    base: float
    V: int

    @classmethod
    def of(cls, folder) -> ClosedForm:
        c = json.loads((Path(folder) / "config.json").read_text())
        alts = {int(i): float(a) for i, a in c["alternatives"]}
        return cls(float(c["scripted_logit"]), alts, float(c["base_logit"]), int(c["vocab_size"]))

    def named(self, t: int) -> list[tuple[int, float]]:
        """(id, logit) of the ids above the base, highest first."""
        named = {**{i: a for i, a in self.alts.items() if i != t}, t: self.A}
        return sorted(named.items(), key=lambda x: -x[1])

    def logit(self, t: int, token: int) -> float:
        return dict(self.named(t)).get(token, self.base)

    def log_z(self, t: int) -> float:
        named = self.named(t)
        rest = (self.V - len(named)) * math.exp(self.base)
        return math.log(sum(math.exp(a) for _, a in named) + rest)

    def logprob(self, t: int, token: int) -> float:
        return self.logit(t, token) - self.log_z(t)

    def top(self, t: int, k: int) -> list[tuple[int, float]]:
        """The top k (id, logprob); k may not reach into the tie of base ids."""
        named = self.named(t)
        assert k <= len(named), "the top k would include an arbitrary base id"
        return [(i, a - self.log_z(t)) for i, a in named[:k]]

    def entry(self, t: int, k: int) -> tuple[int, float, list[tuple[int, float]]]:
        """(id, logprob, top k) of a position that sampled its scripted token t."""
        return t, self.logprob(t, t), self.top(t, k)


def as_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def chat_triples(entries: list[dict]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Chat logprob entries (requested with return_tokens_as_token_ids) as ClosedForm.entry."""
    return [(as_id(e["token"]), e["logprob"],
             [(as_id(t["token"]), t["logprob"]) for t in e["top_logprobs"]]) for e in entries]


def assert_entries(actual: list[tuple], expected: list[tuple], tol: float = 1e-4) -> None:
    """Same ids, in order, and every logprob within `tol`: the server's fp32 log-softmax over
    the 248,320 Qwen ids is off by about 6e-5 from the float64 closed form."""
    ids = [(t, [i for i, _ in top]) for t, _, top in actual]
    assert ids == [(t, [i for i, _ in top]) for t, _, top in expected]
    values = [v for _, lp, top in actual for v in (lp, *(x for _, x in top))]
    assert values == pytest.approx([v for _, lp, top in expected for v in (lp, *(x for _, x in top))],
                                   abs=tol)
