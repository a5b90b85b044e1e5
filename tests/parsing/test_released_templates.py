"""The glm45, mistral, granite and phi4_mini_json parsers on what the released chat templates write (tests/fixtures/
templates): a conversation whose last assistant turn holds reasoning, text and tool calls is
rendered by transformers' apply_chat_template, that turn is tokenized with a vocabulary holding
the format's tokens (special as in the released tokenizers), and the parser, driven as
generation.py drives it, must give back the turn's reasoning, text and calls, token by token and
all at once alike, with logprobs.content covering exactly the content tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from freetoken.parsing import registry
from freetoken.parsing.stage import Label
from tests.parsing.support import tool
from tests.parsing.support import Drive, joined

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "templates"
TOOLS = [tool("get_weather", city={"type": "string"}, days={"type": "integer"}),
         tool("configure", opts={"type": "object"}, note={"type": "string"})]
CALLS = [("get_weather", {"city": "Paris", "days": 3}),
         ("get_weather", {"city": "Köln"}),
         ("configure", {"opts": {"a": [1, 2], "b": None}, "note": "12"})]
USER = {"role": "user", "content": "Weather in Paris and Köln, then configure."}


def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def tokenizer(base: Path, special: list[str], plain: list[str] = ()) -> Any:
    """The tiny BPE of `base` with the format's tokens added; `special` as in its release."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(base / "tokenizer.json"))
    tok.add_tokens(list(plain))
    tok.add_special_tokens({"bos_token": special[0], "eos_token": special[1],
                            "additional_special_tokens": special[2:]})
    return tok


@pytest.fixture(scope="module")
def glm_tok(tiny_harmony_path):
    # GLM-4.5's role markers are special; its think, tool-call and argument tags are not.
    return tokenizer(tiny_harmony_path, ["[gMASK]", "<|endoftext|>", "<sop>", "<|system|>", "<|user|>",
                                         "<|assistant|>", "<|observation|>"],
                     ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                      "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"])


@pytest.fixture(scope="module")
def mistral_tok(tiny_harmony_path):
    # Mistral's control tokens are all special.
    return tokenizer(tiny_harmony_path, ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]",
                                         "[CALL_ID]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                         "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]",
                                         "[/SYSTEM_PROMPT]", "[THINK]", "[/THINK]"])


def assistant(content: str, calls=CALLS, ids: list[str] | None = None, **extra: Any) -> dict:
    ids = ids or [f"abcDEF12{i}" for i in range(len(calls))]
    return {"role": "assistant", "content": content, **extra, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in zip(ids, calls)]}


def render(tok: Any, name: str, messages: list[dict], **kwargs: Any) -> str:
    return tok.apply_chat_template(messages, tools=TOOLS, chat_template=template(name),
                                   tokenize=False, **kwargs)


def parse_turn(tok: Any, text: str, reasoning: str | None, tool_parser: str) -> dict:
    """The turn's ids read token by token and all at once (each as generation.py does): both
    readings agree; returns reasoning, content, calls and the content tokens' text."""
    ids = tok.encode(text, add_special_tokens=False)
    out = []
    for steps in ([[i] for i in ids], [ids]):
        drive = Drive(tok, reasoning, tool_parser, False, tools=TOOLS)
        results = [drive.step(s, [None] * len(s), finished=k == len(steps) - 1)
                   for k, s in enumerate(steps)] + [drive.finish()]
        calls: dict[int, list[str]] = {}
        for item in (c for r in results for c in r.calls):
            entry = calls.setdefault(item.tool_index, ["", ""])
            entry[0] = item.name or entry[0]
            entry[1] += item.parameters
        labels = drive.router.labels
        assert len(labels) == len(ids)
        out.append({"reasoning": "".join(r.reasoning for r in results),
                    "content": "".join(r.content for r in results),
                    "calls": [(n, json.loads(a)) for n, a in calls.values()],
                    "content_tokens": joined(tok, ids, labels, Label.CONTENT)})
    assert out[0] == out[1]
    return out[0]


def test_glm45_reasoning_text_and_typed_calls(glm_tok):
    reasoning = "Two cities, then the settings."
    text = render(glm_tok, "glm-4.5.jinja", [USER, assistant("Checking both.", reasoning_content=reasoning)])
    turn = text[text.rindex("<|assistant|>") + len("<|assistant|>"):]
    # As the template writes a turn: "\n<think>", typed values as JSON, strings as they are.
    assert turn.startswith(f"\n<think>{reasoning}</think>\nChecking both.\n<tool_call>get_weather\n")
    assert "<arg_key>opts</arg_key>\n<arg_value>{\"a\": [1, 2], \"b\": null}</arg_value>" in turn
    got = parse_turn(glm_tok, turn, "glm45", "glm45")
    assert got == {"reasoning": reasoning, "content": "Checking both.\n", "calls": CALLS,
                   "content_tokens": "Checking both.\n"}


def test_glm45_prompts_open_no_think_block(glm_tok):
    on = render(glm_tok, "glm-4.5.jinja", [USER], add_generation_prompt=True)
    off = render(glm_tok, "glm-4.5.jinja", [USER], add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|assistant|>") and off.endswith("<|assistant|>\n<think></think>")
    # The model writes "\n<think>" itself: the output starts outside reasoning either way.
    assert not registry.starts_in_reasoning("glm45", {})
    assert not registry.starts_in_reasoning("glm45", {"enable_thinking": False})
    got = parse_turn(glm_tok, "\nParis is sunny.", "glm45", "glm45")
    assert (got["reasoning"], got["content"], got["calls"]) == ("", "Paris is sunny.", [])


class Templated:
    """A tokenizer seen with another chat template (what `auto` reads)."""

    def __init__(self, tok: Any, chat_template: str) -> None:
        self.tok, self.chat_template = tok, chat_template

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        return self.tok.encode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tok.decode(*args, **kwargs)


def test_auto_picks_glm45_by_its_template(qwen35_tokenizer):
    # Qwen's vocabulary holds </think> and <tool_call> as GLM's does; the template tells.
    glm = Templated(qwen35_tokenizer, template("glm-4.5.jinja"))
    assert registry.resolve("auto", "auto", glm) == ("glm45", "glm45")
    assert registry.resolve("auto", "auto", qwen35_tokenizer) != ("glm45", "glm45")


@pytest.mark.parametrize("name,content", [("mistral-7b-instruct-v0.3.jinja", ""),
                                          ("ministral-3-reasoning-2512.jinja", "Let me check.")])
def test_mistral_calls(mistral_tok, name, content):
    text = render(mistral_tok, name, [USER, assistant(content)])
    turn = text[text.rindex("[/INST]") + len("[/INST]"):].removesuffix("</s>")  # EOS ends it
    layout = "[TOOL_CALLS] [{" if name.startswith("mistral-7b") else "[TOOL_CALLS]get_weather[ARGS]{"
    assert turn.startswith(content + layout), turn
    assert registry.keeps_special_tokens(None, "mistral")  # [TOOL_CALLS] is a special token
    got = parse_turn(mistral_tok, turn, None, "mistral")
    assert got == {"reasoning": "", "content": content, "calls": CALLS, "content_tokens": content}


def test_mistral_call_ids_are_what_its_templates_take(mistral_tok):
    """A tool loop with our ids renders; an OpenAI-style id is refused by the template."""
    ours = [registry.call_id("mistral") for _ in CALLS]
    results = [{"role": "tool", "tool_call_id": i, "content": "{}"} for i in ours]
    for name in ("mistral-7b-instruct-v0.3.jinja", "ministral-3-reasoning-2512.jinja"):
        render(mistral_tok, name, [USER, assistant("", ids=ours), *results])
    openai = [registry.call_id("hermes") for _ in CALLS]
    with pytest.raises(Exception, match="9"):
        render(mistral_tok, "mistral-7b-instruct-v0.3.jinja", [USER, assistant("", ids=openai)])


@pytest.mark.parametrize("tool,name,opener", [
    ("glm45", "glm-4.5.jinja", "<tool_call>"),
    ("mistral", "ministral-3-reasoning-2512.jinja", "[TOOL_CALLS]"),
])
def test_forced_call_grammars_take_the_templates_calls(glm_tok, mistral_tok, tool, name, opener):
    """tool_choice "required" / named: the grammar (its tags the added tokens they are in these
    vocabularies) accepts the calls as the released template writes them."""
    import llguidance

    from freetoken.parsing import tool_grammar
    from freetoken.structured.grammar import ll_tokenizer

    tok = glm_tok if tool == "glm45" else mistral_tok
    text = render(tok, name, [USER, assistant("")])
    calls = text[text.index(opener, text.rindex("<|assistant|>" if tool == "glm45" else "[/INST]")):]
    calls = calls.removesuffix("</s>")
    ll = ll_tokenizer(tok, len(tok), [tok.eos_token_id])
    literal = tool_grammar.token_literal(tok)
    for chosen, parallel, expected in ((None, True, calls), ("get_weather", False, None)):
        one = calls[: calls.index(opener, 1)].rstrip("\n") if expected is None else expected
        grammar, _ = registry.tool_call_grammar(tool, TOOLS, chosen, parallel, literal)
        assert "<[" in grammar  # the tags are matched as tokens
        matcher = llguidance.LLMatcher(ll, llguidance.grammar_from("lark", grammar), log_level=0)
        assert matcher.consume_tokens(tok.encode(one, add_special_tokens=False)), matcher.get_error()
        assert matcher.is_accepting()


@pytest.fixture(scope="module")
def granite_tok(tiny_harmony_path):
    # Granite 3.x's role markers and <|tool_call|> are special; <|end_of_text|> is BOS and EOS.
    return tokenizer(tiny_harmony_path, ["<|end_of_text|>", "<|end_of_text|>", "<|start_of_role|>",
                                         "<|end_of_role|>", "<|tool_call|>"])


@pytest.fixture(scope="module")
def phi4_tok(tiny_harmony_path):
    # Phi-4-mini's role and tool markers are special; functools is plain text.
    return tokenizer(tiny_harmony_path, ["<|endoftext|>", "<|endoftext|>", "<|system|>", "<|user|>",
                                         "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>",
                                         "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>"])


def call_list(calls=CALLS) -> str:
    return json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


@pytest.mark.parametrize("name", ["granite-3.0-8b-instruct.jinja", "granite-3.3-2b-instruct.jinja"])
def test_granite_calls(granite_tok, name):
    """3.0's template writes an `assistant_tool_call` turn as <|tool_call|> and the list; 3.3's
    system prompt asks for that, and its assistant turn is the content as written."""
    prompt = render(granite_tok, name, [USER], add_generation_prompt=True)
    assert prompt.endswith("<|start_of_role|>assistant<|end_of_role|>")
    assert '"name": "get_weather"' in prompt  # the tools are shown
    if name.startswith("granite-3.3"):
        assert "respond only with <|tool_call|> followed by a JSON list of tools used" in prompt
    turn = {"role": "assistant_tool_call", "content": call_list()} if "3.0" in name else \
        {"role": "assistant", "content": "<|tool_call|>" + call_list()}
    text = render(granite_tok, name, [USER, turn])
    head = "<|start_of_role|>assistant<|end_of_role|>"
    turn = text[text.rindex(head) + len(head):].removesuffix("\n").removesuffix("<|end_of_text|>")
    assert turn.startswith('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"')
    assert registry.keeps_special_tokens(None, "granite")  # <|tool_call|> is a special token
    got = parse_turn(granite_tok, turn, None, "granite")
    assert got == {"reasoning": "", "content": "", "calls": CALLS, "content_tokens": ""}
    # tool_choice "required": the grammar (<|tool_call|> matched as its token) takes the turn.
    import llguidance

    from freetoken.parsing import tool_grammar
    from freetoken.structured.grammar import ll_tokenizer

    grammar, _ = registry.tool_call_grammar("granite", TOOLS, None, True, tool_grammar.token_literal(granite_tok))
    assert grammar.startswith("start: <[")
    ll = ll_tokenizer(granite_tok, len(granite_tok), [granite_tok.eos_token_id])
    matcher = llguidance.LLMatcher(ll, llguidance.grammar_from("lark", grammar), log_level=0)
    assert matcher.consume_tokens(granite_tok.encode(turn, add_special_tokens=False)), matcher.get_error()
    assert matcher.is_accepting()


def test_phi4_mini_calls(phi4_tok):
    """Phi-4-mini's template shows the tools of a system message's `tools` field and writes a
    turn as its content; the calls as vLLM's phi4_mini_json reads them (functools[...])."""
    tools = json.dumps([t["function"] for t in TOOLS])
    system = {"role": "system", "content": "You are a helpful assistant with some tools.", "tools": tools}
    prompt = render(phi4_tok, "phi-4-mini-instruct.jinja", [system, USER], add_generation_prompt=True)
    assert f"<|tool|>{tools}<|/tool|><|end|><|user|>" in prompt and prompt.endswith("<|assistant|>")
    content = "Checking both.\n"  # no token of this vocabulary spans "\nf"
    text = render(phi4_tok, "phi-4-mini-instruct.jinja",
                  [system, USER, {"role": "assistant", "content": content + "functools" + call_list()}])
    turn = text[text.rindex("<|assistant|>") + len("<|assistant|>"):].removesuffix("<|endoftext|>")
    turn = turn.removesuffix("<|end|>")  # the model's <|end|> stops it
    assert not registry.keeps_special_tokens(None, "phi4_mini_json")
    got = parse_turn(phi4_tok, turn, None, "phi4_mini_json")
    assert got == {"reasoning": "", "content": content, "calls": CALLS, "content_tokens": content}


def test_auto_tells_granite_and_phi4_mini_apart(granite_tok, phi4_tok):
    """Both vocabularies hold <|tool_call|>: Granite's template tells them apart. (These tiny
    vocabularies hold Harmony's markers too, which `auto` would prefer: each family is asked.)"""
    granite, phi4 = registry.FAMILIES["granite"], registry.FAMILIES["phi4_mini_json"]
    granite_template, phi4_template = template("granite-3.3-2b-instruct.jinja"), template("phi-4-mini-instruct.jinja")
    assert granite.detected(granite_tok, granite_template) and not phi4.detected(granite_tok, granite_template)
    assert granite.detected(granite_tok, template("granite-3.0-8b-instruct.jinja"))
    assert phi4.detected(phi4_tok, phi4_template) and not granite.detected(phi4_tok, phi4_template)
