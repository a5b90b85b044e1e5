"""Structured outputs through the scheduler: valid outputs, EOS, allowed ids, after_ids, batch
invariance, preemption, re-run steps, compiles off the step loop, failures, stats.

JSON outputs come from the default model (a random model's strings may never end); the
mechanics run on the tiny random Qwen3, whose steps are fast.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from freetoken.core import SamplingParams, StructuredSpec
from freetoken.message import DetokenizeMsg, UserMsg
from freetoken.models.registry import load_model
from freetoken.scheduler.factory import build_scheduler
from freetoken.structured.matcher import GrammarCompiler
from tests.model_fixtures import default_model, drain, tiny_random_folder

PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "member"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "member": {"type": "boolean"}}}
# Bounded whatever a random model picks.
TICKET = {"type": "object", "additionalProperties": False, "required": ["level", "ok", "n"],
          "properties": {"level": {"enum": ["low", "mid", "high"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def tiny():
    return load_model(tiny_random_folder("qwen3"), dtype="float32", device="cpu")


def _spec(kind: str, value, after_ids: tuple[int, ...] = ()) -> StructuredSpec:
    return StructuredSpec(kind, value if isinstance(value, str) else json.dumps(value), after_ids)


def _params(spec: StructuredSpec | None, seed: int | None = None, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 48)
    return SamplingParams(temperature=0 if seed is None else 1.0, seed=seed, structured=spec,
                          **kw)


_run = drain


def _tokens(msgs: list[DetokenizeMsg]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def _text(loaded, msgs: list[DetokenizeMsg]) -> str:
    return loaded.tokenizer.decode(_tokens(msgs), skip_special_tokens=True)


def _prompt(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode(text)


@pytest.mark.slow
def test_json_outputs_follow_the_schema():
    loaded = default_model()
    scheduler = build_scheduler(loaded, kv_slots=1024)
    prompt = _prompt(loaded, "Describe a person as JSON with a name, an age and membership:")
    spec = _spec("json_schema", PERSON)
    out = _run(scheduler, {0: (prompt, _params(spec)), 1: (prompt, _params(spec, seed=1)),
                           2: (prompt, _params(spec, seed=2)),
                           3: (prompt, _params(_spec("json_object", "")))})
    for uid in range(4):
        assert out[uid][-1].finish_reason == "stop"
        value = json.loads(_text(loaded, out[uid]))
        jsonschema.validate(value, PERSON if uid < 3 else {"type": "object"})
    stats = scheduler.stats()
    assert (stats["grammar_compiles"], stats["grammar_cache_hits"]) == (2, 2)
    assert stats["grammar_mask_steps"] > 0 and isinstance(stats["grammar_mask_us"], float)
    assert stats["grammar_compiling"] == 0


def test_regex_choice_and_bounded_json_on_a_random_model(tiny):
    scheduler = build_scheduler(tiny, kv_slots=1024)
    prompt = [100, 200, 300, 400]
    choices = ["red", "green", "blue"]
    specs = {0: _spec("regex", r"[a-z]{3,6}-[0-9]{2}"), 1: _spec("choice", choices),
             2: _spec("json_schema", TICKET), 3: _spec("regex", r"(yes|no)!")}
    out = _run(scheduler, {uid: (prompt, _params(spec, seed=uid if uid % 2 else None))
                           for uid, spec in specs.items()})
    texts = {uid: _text(tiny, msgs) for uid, msgs in out.items()}
    assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", texts[0])
    assert texts[1] in choices
    jsonschema.validate(json.loads(texts[2]), TICKET)
    assert texts[3] in ("yes!", "no!")
    # Each ended on EOS once its grammar was complete.
    assert all(msgs[-1].finish_reason == "stop" for msgs in out.values())


def test_eos_waits_for_the_grammar(tiny):
    """EOS is pushed far above everything else: it still comes only where the output is
    complete, and at the first such point."""
    [eos] = tiny.eos_token_ids
    pattern = "[a-z]{5,8}"
    msgs = _run(build_scheduler(tiny, kv_slots=256), {0: ([5, 6, 7], _params(
        _spec("regex", pattern), logit_bias={eos: 100.0}))})[0]
    tokens = _tokens(msgs)
    assert tokens[-1] == eos and msgs[-1].finish_reason == "stop"
    assert re.fullmatch(pattern, tiny.tokenizer.decode(tokens[:-1]))
    assert len(tiny.tokenizer.decode(tokens[:-2])) < 5  # not a token later than it could


def test_allowed_ids_and_the_grammar_both_hold(tiny):
    vocab = tiny.tokenizer.get_vocab()
    [eos] = tiny.eos_token_ids
    allowed = [vocab[c] for c in "17ab"] + [eos]
    msgs = _run(build_scheduler(tiny, kv_slots=256), {0: ([9, 8, 7], _params(
        _spec("regex", "[0-9]{3}"), seed=4, allowed_token_ids=allowed, logprobs=5,
        max_tokens=10))})[0]
    tokens = _tokens(msgs)
    assert re.fullmatch("[17]{3}", tiny.tokenizer.decode(tokens[:3]))
    assert tokens[3:] == [eos]
    lps = [lp for m in msgs for lp in m.logprobs]
    for lp in lps[:3]:  # renormalised over "1" and "7": what the row may sample
        assert set(lp.top_ids) == {vocab["1"], vocab["7"]}
        assert sum(2.718281828459045 ** v for v in lp.top_logprobs) == pytest.approx(1.0)
    assert lps[3].top_ids == [eos] and lps[3].logprob == 0.0


def test_after_ids_leave_the_output_free_until_the_marker(tiny):
    prompt = [11, 12, 13, 14]
    free = _tokens(_run(build_scheduler(tiny, kv_slots=256),
                        {0: (prompt, _params(None, max_tokens=8, ignore_eos=True))})[0])
    marker = (tiny.tokenizer.encode("!", add_special_tokens=False)[0],)
    never = _spec("choice", ["yes", "no"], after_ids=(min(set(range(50, 60)) - set(free)),))
    unmarked = _run(build_scheduler(tiny, kv_slots=256),
                    {0: (prompt, _params(never, max_tokens=8, ignore_eos=True))})[0]
    assert _tokens(unmarked) == free  # no marker: the grammar never starts
    # A marker the logit bias forces first: free itself (the grammar allows no "!"), then the
    # choice follows it.
    marked = _run(build_scheduler(tiny, kv_slots=256), {0: (prompt, _params(
        _spec("choice", ["yes", "no"], after_ids=marker), logit_bias={marker[0]: 50.0}))})[0]
    tokens = _tokens(marked)
    assert tokens[0] == marker[0] and marked[-1].finish_reason == "stop"
    assert tiny.tokenizer.decode(tokens[1:], skip_special_tokens=True) in ("yes", "no")


def _mixed_requests(tiny) -> dict[int, tuple[list[int], SamplingParams]]:
    prompts = [[100 + 7 * i + j for j in range(5 + 3 * i)] for i in range(6)]
    specs = [_spec("json_schema", TICKET), None, _spec("regex", "[a-z]{4,30}"), None,
             _spec("choice", ["alpha", "beta", "gamma"]), _spec("regex", "[0-9]{20,40}")]
    return {uid: (prompts[uid], _params(spec, seed=uid if uid in (1, 2, 5) else None,
                                        max_tokens=24, ignore_eos=spec is None, logprobs=2))
            for uid, spec in enumerate(specs)}


def _alone(tiny, requests, **kw) -> dict[int, list[DetokenizeMsg]]:
    return {uid: _run(build_scheduler(tiny, kv_slots=1024, **kw), {uid: req})[uid]
            for uid, req in requests.items()}


@pytest.mark.parametrize("pool", ["roomy", "preempting"])
def test_structured_rows_equal_each_alone(tiny, pool):
    requests = _mixed_requests(tiny)
    alone = _alone(tiny, requests, prefix_cache=False)
    scheduler = build_scheduler(tiny, kv_slots=1024 if pool == "roomy" else 72,
                                prefix_cache=False)
    # Compiled first: a grammar still compiling (in the pool) holds its request back, and how
    # long depends on the machine's load, so would the preemptions.
    for _, params in requests.values():
        if params.structured is not None:
            grammar = scheduler.grammars.start(params.structured)
            while not grammar.resolve():
                time.sleep(0.01)
    together = _run(scheduler, requests)
    if pool == "preempting":  # the matcher stays with a preempted request
        assert scheduler.stats()["preemptions"] >= 2
    for uid in requests:
        assert _tokens(together[uid]) == _tokens(alone[uid])
        assert [lp for m in together[uid] for lp in m.logprobs] == [
            lp for m in alone[uid] for lp in m.logprobs]  # every bit
    assert re.fullmatch("[0-9]{20,24}", _text(tiny, together[5]))  # long enough to be preempted


def test_a_rerun_step_feeds_each_matcher_once(tiny):
    requests = _mixed_requests(tiny)
    expected = _run(build_scheduler(tiny, kv_slots=1024, prefix_cache=False), requests)
    scheduler = build_scheduler(tiny, kv_slots=1024, prefix_cache=False)
    sample, batched, failures = scheduler.engine.sampler.sample, [], []

    def flaky_sample(logits, args):  # every third batched step fails, after it has sampled
        out = sample(logits, args)
        if args.batch_size > 1:
            batched.append(args.batch_size)
            if len(batched) % 3 == 0 and len(failures) < 4:
                failures.append(args.batch_size)
                raise RuntimeError("flaky")
        return out

    scheduler.engine.sampler.sample = flaky_sample
    out = _run(scheduler, requests)
    assert len(failures) == 4
    for uid in requests:
        assert _tokens(out[uid]) == _tokens(expected[uid])


def test_a_slow_compile_does_not_hold_up_other_requests(tiny, monkeypatch):
    release, started = threading.Event(), threading.Event()
    compile_ = GrammarCompiler._compile

    def slow_compile(self, spec):
        started.set()
        assert release.wait(30)
        return compile_(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow_compile)
    scheduler = build_scheduler(tiny, kv_slots=256)
    try:
        scheduler.add(UserMsg(0, [5, 6, 7], _params(_spec("regex", "[a-z]{3}"))))
        scheduler.add(UserMsg(1, [8, 9, 10], _params(None, max_tokens=6, ignore_eos=True)))
        assert started.wait(30)
        done = []
        while not done:
            replies = scheduler.step()
            assert {m.uid for m in replies} <= {1}
            done = [m for m in replies if m.finished]
        assert scheduler.stats()["grammar_compiling"] == 1 and scheduler.has_work
        assert [r.uid for r in scheduler.waiting] == [0] and not scheduler.running
    finally:
        release.set()
    out = _run(scheduler)
    assert re.fullmatch("[a-z]{3}", _text(tiny, out[0])) and out[0][-1].finish_reason == "stop"


def test_a_grammar_that_fails_to_compile_is_refused_alone(tiny):
    scheduler = build_scheduler(tiny, kv_slots=256)
    requests = {0: ([5, 6], _params(_spec("regex", "[a-"))),
                1: ([5, 6], _params(None, max_tokens=4, ignore_eos=True)),
                2: ([5, 6], _params(_spec("lark", "start: nothing_defined"))),
                3: ([5, 6], _params(_spec("choice", ["ok"])))}
    out = _run(scheduler, requests)
    for uid in (0, 2):
        [msg] = out[uid]
        assert (msg.finished, msg.finish_reason, msg.error_code) == (True, "error",
                                                                      "invalid_request")
        assert msg.error.startswith("The structured output grammar does not compile")
    assert len(_tokens(out[1])) == 4 and _text(tiny, out[3]) == "ok"
    assert not scheduler.has_work and not scheduler.compiling


def test_max_tokens_ends_an_incomplete_output_with_length(tiny):
    msgs = _run(build_scheduler(tiny, kv_slots=256), {0: ([5, 6, 7], _params(
        _spec("json_schema", TICKET), max_tokens=5))})[0]
    text = _text(tiny, msgs)
    assert msgs[-1].finish_reason == "length" and len(_tokens(msgs)) == 5
    assert text.startswith('{"') and not text.endswith("}")


def test_abort_while_compiling(tiny, monkeypatch):
    release = threading.Event()
    compile_ = GrammarCompiler._compile
    monkeypatch.setattr(GrammarCompiler, "_compile",
                        lambda self, spec: (release.wait(30), compile_(self, spec))[1])
    scheduler = build_scheduler(tiny, kv_slots=256)
    scheduler.add(UserMsg(0, [5, 6], _params(_spec("regex", "[a-z]"))))
    assert scheduler.step() == []
    [msg] = scheduler.abort(0)
    release.set()
    assert msg.finish_reason == "abort" and not scheduler.has_work and not scheduler.compiling


def test_a_row_left_with_no_token_ends_with_an_error(tiny):
    """allowed_token_ids that the grammar refuses leave the row nothing to sample: that request
    ends with an error reply, the engine and its other requests go on."""
    z = tiny.tokenizer.get_vocab()["z"]
    scheduler = build_scheduler(tiny, kv_slots=256)
    out = _run(scheduler, {
        0: ([5, 6], _params(_spec("choice", ["yes"]), allowed_token_ids=[z])),
        1: ([5, 6], _params(_spec("choice", ["yes"]), seed=1, allowed_token_ids=[z])),
        2: ([7, 8], _params(None, max_tokens=4, ignore_eos=True))})
    for uid in (0, 1):
        [msg] = out[uid]
        assert (msg.finish_reason, msg.error_code) == ("error", "invalid_request")
        assert msg.error.startswith("The output cannot continue under its grammar")
    assert len(_tokens(out[2])) == 4 and not scheduler.has_work
