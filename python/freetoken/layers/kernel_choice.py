"""Which kernel runs a linear shape, decided at load by a probe on the running CPU.

Batch invariance needs a row's bits not to depend on how many rows share its matmul call. No
library promises that, and it changes with the CPU, its ISA, the dtype, the shape and the
thread count (MKL's sgemm on an Intel Xeon with AMX splits rows 1 | 2-15 | 16+ into three
results, oneDNN's AMX bfloat16 kernel rows 1-32 | 33+ at two threads, each of them invariant
on the AMD machine of an earlier round). So nothing is assumed: for each shape and dtype every
candidate kernel is run (on weights and rows built to expose its summation order:
`probe_weight`) at the row counts of PROBE_ROWS, each row compared bit for bit with
the same row computed among `rule.most` rows, start- and end-aligned (a row's position in its
call moves too). Each `RowRule` of RULES under which the candidate passes is costed: calls
padded to at least `minimum` rows and split into calls of at most `most` rows (the layer does
both; beyond the probed counts nothing is claimed), from timings of every candidate's calls
taken in turn (`plan_seconds`: timed one after the other, they win or lose on a shared
machine's noise). The fastest (kernel, rule) wins. Where none passes, the fastest runs and the load says the model is not
batch-invariant (the log, `/v1/stats`, `/metrics`).

Probes take seconds on a large shape, so their results are kept in the cache folder, keyed by
everything that changes a kernel's bits or speed: the CPU's name and flags, the ISA caps
oneDNN, MKL and ATen read from the environment, torch's version, the thread count, dtype and
shape. A lock makes concurrent loads (test workers, tensor-parallel ranks) probe a shape once
and agree on the result.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable

import torch

from freetoken import envs
from freetoken.paths import cache_root
from freetoken.kernels import bf16_linear, build, grouped_gemm

Run = Callable[[torch.Tensor], torch.Tensor]

PROBE_MOST = 256
UNCAPPED = sys.maxsize  # a rule's `most` for a kernel whose calls need no cap (layers/linear.py)
PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 13, 15, 16, 17, 31, 32, 33, 48, 57, 64, 65, 100, 128, 129,
              200, 255)
# Decode steps run 1-32 rows, scoring and prefill steps hundreds: each weighs the same.
TIMED_ROWS = (1, 8, 64, 256)
TIMING_REPEATS = 7
# A wide shape's rounds take seconds (an LM head's 256-row calls of each candidate): past this
# much timing, MIN_TIMING_REPEATS rounds decide, as noise matters less on calls that long.
TIMING_BUDGET_S = 2.0
MIN_TIMING_REPEATS = 3
RULE_TIE = 0.05
# The C sources of the candidates that are ours, and the header they include.
OUR_KERNELS = (grouped_gemm.SOURCE, bf16_linear.SOURCE, build.HEADER)
ISA_CAPS = (*envs.ISA_CAPS, envs.NO_KERNELS)


@dataclass(frozen=True)
class RowRule:
    """Row counts at which a kernel gives each row the bits it gets at any other such count:
    calls of `minimum` to `most` rows."""

    minimum: int = 1
    most: int = PROBE_MOST

    def pad(self, rows: int) -> int:
        """Rows to add to a call of `rows` rows."""
        return max(self.minimum - rows, 0)

    def calls(self, rows: int) -> list[int]:
        """Call sizes, each allowed, that cover `rows` (>= minimum) rows in order."""
        sizes = [self.most] * (rows // self.most)
        rest = rows - sum(sizes)
        if rest and rest < self.minimum:  # the last full call lends the rest its minimum
            sizes[-1] -= self.minimum - rest
            rest = self.minimum
        return sizes + [rest] if rest else sizes


# `most` at least twice `minimum`, so that any count can be split. (64, 256): oneDNN's AMX
# bfloat16 kernel at two threads gives rows 33-300 one result and 1-32 another here.
RULES = (RowRule(1, 256), RowRule(2, 256), RowRule(16, 256), RowRule(64, 256), RowRule(1, 32),
         RowRule(2, 32), RowRule(16, 32))


def run_by_rule(run: Run, rule: RowRule, x: torch.Tensor) -> torch.Tensor:
    """`run` over x [rows, in] in calls of the sizes `rule` allows (x's rows already padded)."""
    if x.shape[0] <= rule.most:
        return run(x)
    return torch.cat([run(part) for part in x.split(rule.calls(x.shape[0]))])


def probe_weight(out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """Weights for probing a shape (what a kernel does depends on shape and dtype, not values),
    built so that `probe_rows` times them cancels: input k and input pair(k) carry v and -v,
    weight columns k and pair(k) the same u, over a random pairing. Each output is then fp32
    rounding residue alone, whose bits follow the summation order; on the layer's own weights a
    different order shows in a bfloat16 output only when it moves a rounding, rarely (seen: one
    row in 256 on a kernel that splits rows 1 | 2+)."""
    first, second = _pairing(in_features)
    gen = torch.Generator().manual_seed(1)
    weight = torch.zeros(out_features, in_features)
    weight[:, first] = weight[:, second] = torch.randn(out_features, len(first), generator=gen)
    return weight.to(dtype)


def probe_rows(rows: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    first, second = _pairing(in_features)
    gen = torch.Generator().manual_seed(0)
    x = torch.zeros(rows, in_features)
    x[:, first] = torch.randn(rows, len(first), generator=gen)
    x[:, second] = -x[:, first]
    return x.to(dtype)


def _pairing(in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(2))
    half = in_features // 2
    return order[:half], order[half : 2 * half]


@torch.inference_mode()
def rules_holding(run: Run, in_features: int, dtype: torch.dtype, rules: tuple[RowRule, ...] = RULES,
                  device: torch.device | str = "cpu") -> list[RowRule]:
    """The rules of `rules` under which every probed row count gives each row the bits it gets
    among `rule.most` rows, at either end of its call. `run` holds `probe_weight`'s weights.
    Rules with one `most` share its reference run and each row count's comparison (a count is
    run when a rule first asks for it): on a wide layer each call is tens of milliseconds."""
    references: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    alike: dict[tuple[int, int], bool] = {}

    def alike_at(most: int, n: int) -> bool:
        if (most, n) not in alike:
            if most not in references:
                x = probe_rows(most, in_features, dtype).to(device)
                references[most] = x, run(x)
            x, reference = references[most]
            alike[most, n] = (torch.equal(run(x[:n]), reference[:n])
                              and torch.equal(run(x[-n:]), reference[-n:]))
        return alike[most, n]

    return [rule for rule in rules
            if all(alike_at(rule.most, n) for n in PROBE_ROWS if rule.minimum <= n < rule.most)]


def rule_holds(run: Run, in_features: int, dtype: torch.dtype, rule: RowRule,
               device: torch.device | str = "cpu") -> bool:
    return bool(rules_holding(run, in_features, dtype, (rule,), device))


Plan = tuple[int, ...]  # the sizes of the calls one rule makes of a number of rows


def plans(rule: RowRule) -> list[Plan]:
    """The calls `rule` makes of each number of rows of TIMED_ROWS, padding included."""
    return [tuple(rule.calls(n + rule.pad(n))) for n in TIMED_ROWS]


@torch.inference_mode()
def plan_seconds(runs: dict[str, Run], timed: dict[str, set[Plan]], in_features: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[tuple[str, Plan], float]:
    """The best of TIMING_REPEATS runs (or of the rounds run by TIMING_BUDGET_S, at least
    MIN_TIMING_REPEATS) of each kernel's plans (its calls in a row), every
    (kernel, plan) taken in turn in each round: what is compared then meets a shared machine's
    busy spells alike (timed one after the other, the one timed in a quiet spell won, and a
    rule capped at 32 rows or padded to 64 rows often did)."""
    x = torch.randn(max(max(p) for ps in timed.values() for p in ps), in_features)
    x = x.to(dtype=dtype, device=device)
    order = [(kernel, plan) for kernel, ps in timed.items() for plan in sorted(ps)]
    best = dict.fromkeys(order, math.inf)
    started = time.perf_counter()
    for repeat in range(TIMING_REPEATS + 1):  # round 0 warms the kernels up, untimed
        if repeat > MIN_TIMING_REPEATS and time.perf_counter() - started > TIMING_BUDGET_S:
            break
        for kernel, plan in order:
            start = time.perf_counter()
            for size in plan:
                runs[kernel](x[:size])
            if x.device.type == "cuda":
                torch.cuda.synchronize()
            if repeat:
                best[kernel, plan] = min(best[kernel, plan], time.perf_counter() - start)
    return best


def rule_seconds(timings: dict[Plan, float], rule: RowRule) -> float:
    """Geometric mean over TIMED_ROWS of a call's time under `rule`, from its plans' timings."""
    logs = [math.log(max(timings[plan], 1e-9)) for plan in plans(rule)]
    return math.exp(sum(logs) / len(logs))


@dataclass(frozen=True)
class Measured:
    """One candidate kernel on one shape: its rule (None: no rule of RULES holds) and speed."""

    kernel: str
    rule: RowRule | None
    seconds: float


def measure(runs: dict[str, Run], in_features: int, dtype: torch.dtype,
            device: torch.device) -> list[Measured]:
    """Each kernel of `runs` under its fastest rule of RULES that holds (rule None: none holds;
    a kernel that cannot run the dtype after all is left out). A rule's time is the geometric
    mean over TIMED_ROWS of its plans' timings, all kernels' plans timed in turn (plan_seconds);
    a kernel's rules within RULE_TIE of its fastest count as ties, and the widest of those wins
    (timings move by a few % from run to run on a loaded machine: noise would pick otherwise)."""
    holding: dict[str, list[RowRule]] = {}
    for kernel, run in runs.items():
        try:
            holding[kernel] = rules_holding(run, in_features, dtype, RULES, device)
        except RuntimeError:  # a kernel that packed a dtype it then cannot run
            continue
    timed = {kernel: rules or [RowRule()] for kernel, rules in holding.items()}
    if not timed:
        return []
    timings = plan_seconds(runs, {kernel: {p for rule in rules for p in plans(rule)}
                                  for kernel, rules in timed.items()}, in_features, dtype, device)
    measured = []
    for kernel, rules in timed.items():
        own = {plan: t for (k, plan), t in timings.items() if k == kernel}
        costs = [(rule, rule_seconds(own, rule)) for rule in rules]
        best = min(cost for _, cost in costs)
        ties = [(rule, cost) for rule, cost in costs if cost <= best * (1 + RULE_TIE)]
        rule, cost = max(ties, key=lambda t: (t[0].most - t[0].minimum, -t[0].minimum))
        measured.append(Measured(kernel, rule if holding[kernel] else None, cost))
    return measured


def ranked(measured: list[Measured]) -> list[Measured]:
    """Batch-invariant candidates first, each group fastest first."""
    return sorted(measured, key=lambda m: (m.rule is None, m.seconds))


def measured_with_cache(key: str, probe: Callable[[], list[Measured]]) -> list[Measured]:
    """`probe()`'s result for this shape and these candidates on this machine, probed once (an
    empty result, no candidate running here, is asked again next time)."""
    def stored() -> dict | None:
        return {m.kernel: {"rule": [m.rule.minimum, m.rule.most] if m.rule else None,
                           "seconds": m.seconds} for m in probe()} or None

    entries = probed_once(key, stored) or {}
    return [Measured(kernel, RowRule(*e["rule"]) if e["rule"] else None, e["seconds"])
            for kernel, e in entries.items()]


def probed_once(key: str, probe: Callable[[], object]):
    """`probe()`'s result (JSON) under `key` on this machine, from the cache folder if it was
    probed before (None is not kept: asked again next time)."""
    path = cache_root() / "kernels" / f"probes-{_machine()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = json.loads(path.read_text()) if path.is_file() else {}
        if key in entries:
            return entries[key]
        result = probe()
        if result is None:
            return None
        entries[key] = result
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, path)
        return result


def cpu_name() -> str:
    """The CPU's model name and the widest ISA torch's own kernels use here."""
    name = _cpuinfo_line("model name") or platform.processor() or platform.machine()
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


@cache
def _cpuinfo_line(field: str) -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(field)), "")


@cache
def _our_kernels() -> str:
    return hashlib.sha256(b"".join(source.read_bytes() for source in OUR_KERNELS)).hexdigest()


def _machine() -> str:
    caps = [f"{env.name}={env.get() or ''}" for env in ISA_CAPS]
    # The probe's settings and our own kernels' source too: a change to them probes anew.
    text = "|".join([cpu_name(), _cpuinfo_line("flags"), torch.__version__,
                     str(torch.get_num_threads()), *caps,
                     repr((RULES, PROBE_ROWS, TIMED_ROWS, TIMING_REPEATS, TIMING_BUDGET_S,
                           MIN_TIMING_REPEATS, RULE_TIE)), _our_kernels()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
