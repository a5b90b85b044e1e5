"""Chat logprobs with reasoning and tool parsers active (issue 7), through `freetoken serve`.

Each case runs non-streamed (openai client) and streamed (httpx SSE): the two must agree, the
streamed chunks must follow rules 4-5 (an entry rides only on a content delta or the finish
chunk), and every entry must equal the scripted model's closed form at its script position.
Positions are found from the script's bytes: the tokens that overlap the expected content (or
reasoning) text.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer

from tests.fixtures import build_models as bm
from tests.support.bpe import positions, token_bytes
from tests.support.chat import HARMONY_SCRIPTS, NO_THINKING, RULE6, chat_scripts
from tests.support.scripted_logits import ClosedForm, assert_entries, chat_triples
from tests.support.sse import chat_view, merge_chat_stream, sse

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scripted_server(server, scripted_model_path):
    """The default script; auto picks the qwen3 reasoning and hermes tool parsers."""
    return server("--model", str(scripted_model_path))


@pytest.fixture(scope="module")
def chat_server(server, chat_model_path):
    """chat_model_path with qwen3 reasoning (auto) and the qwen3_coder tool parser."""
    return server("--model", str(chat_model_path), "--tool-call-parser", "qwen3_coder")


@pytest.fixture(scope="module")
def plain_server(server, chat_model_path):
    """chat_model_path with no parser at all."""
    return server("--model", str(chat_model_path), "--reasoning-parser", "off",
                  "--tool-call-parser", "off")


@pytest.fixture(scope="module")
def harmony_server(server, harmony_scripted_path):
    """The Harmony scripted model; auto picks the gpt_oss reasoning and tool parsers."""
    return server("--model", str(harmony_scripted_path))


K = 2  # top_logprobs: the scripted token and the best alternative, never the base-logit tie
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


@dataclass
class Target:
    """A running server with what the test needs to predict it: tokenizer, logits, scripts."""

    server: object
    tok: object
    form: ClosedForm
    scripts: dict  # trigger -> scripted ids


@pytest.fixture(scope="module")
def default_target(scripted_server, scripted_model_path, qwen35_tokenizer):
    tok = qwen35_tokenizer
    scripts = {e["trigger"]: tok.encode(e["text"], add_special_tokens=False) for e in bm.DEFAULT_SCRIPT}
    return Target(scripted_server, tok, ClosedForm.of(scripted_model_path), scripts)


@pytest.fixture(scope="module")
def chat_target(chat_server, chat_model_path, qwen35_tokenizer):
    tok = qwen35_tokenizer
    return Target(chat_server, tok, ClosedForm.of(chat_model_path), chat_scripts(tok))


@pytest.fixture(scope="module")
def plain_target(plain_server, chat_model_path, qwen35_tokenizer):
    tok = qwen35_tokenizer
    return Target(plain_server, tok, ClosedForm.of(chat_model_path), chat_scripts(tok))


@pytest.fixture(scope="module")
def harmony_target(harmony_server, harmony_scripted_path):
    tok = AutoTokenizer.from_pretrained(str(harmony_scripted_path))
    scripts = {e["trigger"]: tok.encode(e["text"], add_special_tokens=False) for e in HARMONY_SCRIPTS}
    return Target(harmony_server, tok, ClosedForm.of(harmony_scripted_path), scripts)


def ask(target: Target, prompt: str, extra: dict | None = None, **native) -> dict:
    """The chat reply in chat_view's shape, after checking stream == non-stream and that no
    entry rides on a reasoning or tool-call chunk."""
    extra = {"return_tokens_as_token_ids": True, **(extra or {})}
    messages = [{"role": "user", "content": prompt}]
    full = target.server.client().chat.completions.create(
        model=None, messages=messages, temperature=0, logprobs=True, top_logprobs=K,
        extra_body=extra, **native)
    choice = full.choices[0].model_dump()
    assert choice["logprobs"]["refusal"] is None
    body = {"messages": messages, "temperature": 0, "logprobs": True, "top_logprobs": K,
            **extra, **native}
    events = sse(target.server, "/v1/chat/completions", body)
    on_finish = 0
    for ev in events:
        for c in ev["choices"]:
            delta, last = c["delta"], c["finish_reason"] is not None
            if entries := (c.get("logprobs") or {}).get("content"):
                assert not delta.get("reasoning_content") and not delta.get("tool_calls")
                assert delta.get("content") or last
                on_finish += len(entries) if last else 0
            if (c.get("reasoning_logprobs") or {}).get("content"):
                assert not delta.get("content") and not delta.get("tool_calls")
                assert delta.get("reasoning_content") or last
    view, streamed = chat_view(choice), merge_chat_stream(events)
    view.pop("call_ids"), streamed.pop("call_ids")
    assert streamed == view
    view["has_reasoning_logprobs"] = choice.get("reasoning_logprobs") is not None
    view["on_finish"] = on_finish  # content entries that rode on the finish chunk
    return view


def expected(target: Target, ids: list[int], text: str | None, start: str = "") -> list[tuple]:
    """Closed-form entries of the tokens that make up `text` (none if it is None)."""
    if text is None:
        return []
    return [target.form.entry(ids[j], K) for j in positions(target.tok, ids, text, start)]


@dataclass
class Case:
    target: str  # fixture name
    prompt: str
    trigger: str | None  # which script the prompt selects
    content: str | None  # expected message content (None: tool-only or cut in reasoning)
    reasoning: str | None
    finish: str
    fields: dict
    shown: str | None = None  # what the content entries' bytes spell, if not `content`
    on_finish: int = 0  # content entries labelled only at the end (rule 5)


CASES = {
    "thinking then answer": Case("default_target", "hi", None, "Use a <b> tag.", "Let me think.",
                                 "stop", {}),
    "thinking off": Case("default_target", "hi", "<think>\n\n</think>\n\n", "Use a <b> tag.", None,
                         "stop", {"extra": NO_THINKING}),
    "tool-only turn": Case("default_target", "Weather in Paris?", "weather", None,
                           "The user wants the weather.", "tool_calls", {"tools": [WEATHER]}),
    "length inside reasoning": Case("default_target", "hi", None, None, "Let me think", "length",
                                    {"max_tokens": 3}),
    "content then two calls": Case("chat_target", "[two-calls]", "[two-calls]", "One moment.\n",
                                   "I should look both up.", "tool_calls", {"tools": [WEATHER, TIME]}),
    "content then bare call": Case("chat_target", "[bare-call]", "[bare-call]", "Sure thing\n",
                                   "Checking.", "tool_calls", {"tools": [TIME]}),
    "held to the finish chunk": Case("chat_target", "[held]", "[held]", "Call <function",
                                     "Checking.", "stop", {"tools": [TIME]}, on_finish=1),
    "stop string cuts a token": Case("chat_target", "[emoji]", "[emoji]", "Hot 🙂 day. Nice w",
                                     "Thinking.", "stop", {"stop": ["eat"]},
                                     shown="Hot 🙂 day. Nice weather"),
    "harmony final": Case("harmony_target", "hi", None, "Use a <b> tag.", "Let me think.", "stop", {}),
    "harmony tool call": Case("harmony_target", "Weather in Paris?", "weather", None,
                              "Need the weather.", "tool_calls", {"tools": [WEATHER]}),
}


@pytest.mark.parametrize("with_reasoning", [False, True], ids=["content", "with-reasoning"])
@pytest.mark.parametrize("name", list(CASES))
def test_entries_are_the_visible_content(request, name, with_reasoning):
    case = CASES[name]
    target = request.getfixturevalue(case.target)
    fields = dict(case.fields)
    extra = {**fields.pop("extra", {}), "include_reasoning_logprobs": with_reasoning}
    got = ask(target, case.prompt, extra, **fields)

    ids = target.scripts[case.trigger]
    assert got["finish_reason"] == case.finish and got.pop("on_finish") == case.on_finish
    assert got["content"] == (case.content or "") and got["reasoning"] == (case.reasoning or "")
    content = expected(target, ids, case.content, start=case.reasoning or "")
    assert_entries(chat_triples(got["logprobs"]), content)
    shown = case.shown or case.content or ""
    assert b"".join(bytes(e["bytes"]) for e in got["logprobs"]) == shown.encode()
    assert all(bytes(e["bytes"]) == token_bytes(target.tok, t) for e, (t, _, _) in
               zip(got["logprobs"], content))
    assert got["has_reasoning_logprobs"] == with_reasoning
    reasoning = expected(target, ids, case.reasoning) if with_reasoning else []
    assert_entries(chat_triples(got["reasoning_logprobs"]), reasoning)


def test_rule6_thinking_off_and_tool_choice_none_equal_no_parser(chat_target, plain_target):
    """Rule 6: markers and tool markup inside content stay content, exactly as with no parser."""
    kw = {"extra": NO_THINKING, "tools": [TIME], "tool_choice": "none"}
    parsed, plain = ask(chat_target, "[rule6]", **kw), ask(plain_target, "[rule6]", **kw)
    assert parsed["content"] == plain["content"] == RULE6
    assert parsed["logprobs"] == plain["logprobs"]
    ids = chat_target.scripts["[rule6]"]
    assert_entries(chat_triples(parsed["logprobs"]), [chat_target.form.entry(t, K) for t in ids])
