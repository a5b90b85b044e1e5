"""The reasoning stages (qwen3's ThinkSplitter, glm45's Glm45Splitter, Harmony's HarmonySplitter)
through the output parser on text alone: hand-written expectations, an independent reference
for qwen3 and glm45, and stream == non-stream for arbitrary chunkings (including one character
at a time)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings, strategies as st

from freetoken.parsing import registry
from freetoken.parsing.harmony import HARMONY_MARKERS
from freetoken.parsing.machine import Step, join_steps
from freetoken.parsing.stage import partial_suffix_len

FAST = settings(max_examples=150, deadline=None)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c for c in cuts if 0 < c < len(text)})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def rc(step: Step) -> tuple[str, str]:
    return step.reasoning, step.content


def parser(name: str, force: bool = False):
    return registry.output_parser(reasoning=name, force_reasoning=force)


def non_stream(name: str, force: bool, text: str) -> tuple[str, str]:
    return rc(registry.parse_text(text, reasoning=name, force_reasoning=force))


def stream(name: str, force: bool, pieces: list[str]) -> tuple[str, str]:
    p = parser(name, force)
    deltas = [rc(p.feed_text(piece)) for piece in pieces] + [rc(p.finish())]
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas)


def chunkings(text: str) -> list[list[str]]:
    """Whole, one char at a time, and a few fixed widths."""
    return [[text], list(text)] + [[text[i : i + w] for i in range(0, len(text), w)] for w in (2, 3, 7)]


TOOL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
HARMONY_TOOL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'

CASES = [
    # (family, force_reasoning, output, reasoning, content)
    ("qwen3", True, "Let me think.</think>\n\nUse a <b> tag.", "Let me think.", "Use a <b> tag."),
    ("qwen3", True, "<think>\nOkay, 2+2.\n</think>\n\n4", "Okay, 2+2.", "4"),
    ("qwen3", True, "</think>\n\nHi", "", "Hi"),
    ("qwen3", True, "Hmm, let me see.\n\n", "Hmm, let me see.", ""),
    ("qwen3", True, "Still thinking about </thi", "Still thinking about </thi", ""),
    ("qwen3", True, "I should call it.\n" + TOOL, "I should call it.", TOOL),
    ("qwen3", True, TOOL, "", TOOL),
    ("qwen3", True, "a</think>b</think><think>c <tool_call>", "a", "b</think><think>c <tool_call>"),
    ("qwen3", True, "x<think>y</think>z", "x<think>y", "z"),
    ("qwen3", True, "r</think>\n\n" + TOOL + "\nDone.", "r", TOOL + "\nDone."),
    ("qwen3", True, "", "", ""),
    ("qwen3", False, "Plain answer with <think> inside.", "", "Plain answer with <think> inside."),
    ("qwen3", False, "  leading space\n", "", "  leading space\n"),
    ("qwen3", False, "<think>hmm</think>answer", "hmm", "answer"),
    ("qwen3", False, "<think>truncated", "truncated", ""),
    ("qwen3", False, "<thin", "", "<thin"),
    ("qwen3", False, TOOL, "", TOOL),
    # GLM-4.5 writes "\n<think>" itself; its leading whitespace is dropped, content or not
    ("glm45", False, "\n<think>Let me see.\n</think>\nUse a <b> tag.", "Let me see.", "Use a <b> tag."),
    ("glm45", False, "\n<think></think>\n" + TOOL, "", TOOL),
    ("glm45", False, "\nHello <think>", "", "Hello <think>"),
    ("glm45", False, " \n <thi", "", "<thi"),
    ("glm45", False, "\n<think>cut off", "cut off", ""),
    ("glm45", False, "\n\n", "", ""),
    ("glm45", False, "<think>I should call it.\n" + TOOL, "I should call it.", TOOL),
    ("gpt_oss", False, "<|channel|>analysis<|message|>think hard<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>", "think hard", "Hi!"),
    ("gpt_oss", False, "<|start|>assistant<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b<|return|>", "a", "b"),
    ("gpt_oss", False, "<|channel|>analysis<|message|>need weather<|end|>" + HARMONY_TOOL, "need weather", HARMONY_TOOL),
    ("gpt_oss", False, "<|channel|>commentary<|message|>Checking now.<|end|>" + HARMONY_TOOL, "", "Checking now." + HARMONY_TOOL),
    ("gpt_oss", False, "just text, no markers", "", "just text, no markers"),
    ("gpt_oss", False, "<|channel|>analysis<|message|>partial thou", "partial thou", ""),
    ("gpt_oss", False, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|chan", "a", ""),
    ("gpt_oss", False, "<|channel|>analysis<|message|>a<|en", "a<|en", ""),
    (
        "gpt_oss", False,
        "<|channel|>commentary to=functions.f<|message|>{}<|start|>assistant<|channel|>final<|message|>ok<|return|>",
        "", "<|channel|>commentary to=functions.f<|message|>{}<|call|>ok",
    ),
    ("gpt_oss", False, "<|channel|>commentary to=functions.f<|message|>{\"a\": ", "", "<|channel|>commentary to=functions.f<|message|>{\"a\": "),
    ("gpt_oss", False, "<|channel|>final<|message|>x<|constrain|>y<|message|>z<|return|>", "", "xyz"),
    ("gpt_oss", False, "<|start|>assistant<|end|>after", "", "after"),
    ("gpt_oss", True, "thinking...<|end|><|start|>assistant<|channel|>final<|message|>Answer<|return|>", "thinking...", "Answer"),
]


@pytest.mark.parametrize("family,force,text,reasoning,content", CASES)
def test_scripted_outputs_in_every_chunking(family, force, text, reasoning, content):
    assert non_stream(family, force, text) == (reasoning, content)
    for pieces in chunkings(text):
        assert stream(family, force, pieces) == (reasoning, content), pieces


def test_seed_example_token_by_token():
    # Token pieces as a Qwen3 tokenizer splits the text: '</think>' is one token, ' <' another.
    tokens = ["Let", " me", " think", ".", "</think>", "\n\n", "Use", " a", " <", "b", ">", " tag", "."]
    p = parser("qwen3", force=True)
    deltas = [rc(p.feed_text(t)) for t in tokens]
    assert deltas[4:8] == [("", ""), ("", ""), ("", "Use"), ("", " a")]
    assert deltas[8] == ("", " <"), "a '<' in content is not a marker prefix and is not held"
    assert rc(p.finish()) == ("", "")
    joined = ("".join(r for r, _ in deltas), "".join(c for _, c in deltas))
    expected = ("Let me think.", "Use a <b> tag.")
    assert joined == expected == non_stream("qwen3", True, "".join(tokens))


def test_split_end_marker_is_held_then_resolved():
    p = parser("qwen3", force=True)
    assert rc(p.feed_text("abc </th")) == ("abc", "")
    assert rc(p.feed_text("ink>\nxyz")) == ("", "xyz")
    p = parser("qwen3", force=True)
    assert rc(p.feed_text("a <")) == ("a", "")
    assert rc(p.feed_text("b>")) == (" <b>", "")


def test_harmony_partial_marker_is_held_and_never_leaks():
    p = parser("gpt_oss")
    assert rc(p.feed_text("<|channel|>analysis<|mess")) == ("", "")
    assert rc(p.feed_text("age|>one <|")) == ("one ", "")
    assert rc(p.feed_text("end|><|start|>assistant<|channel|>final<|message|>two")) == ("", "two")
    assert rc(p.feed_text("<|return|>")) == ("", "")
    assert rc(p.finish()) == ("", "")


def test_parse_non_stream_leaves_stream_state_alone():
    p = parser("qwen3", force=True)
    assert rc(p.feed_text("one")) == ("one", "")
    assert non_stream("qwen3", True, "x</think>y") == ("x", "y")
    assert rc(p.feed_text(" two</think>z")) == (" two", "z")


def test_registry_and_builder():
    assert set(registry.REASONING_PARSERS) == {"qwen3", "gpt_oss", "glm45"}
    assert registry.reasoning_family(None) is None and registry.reasoning_family("off") is None
    built = parser("qwen3", force=True)
    assert built is not None and rc(join_steps([built.feed_text("a</think>b"), built.finish()])) == ("a", "b")
    with pytest.raises(ValueError):
        registry.output_parser(reasoning="harmony")


def test_partial_suffix_len():
    assert partial_suffix_len("abc </th", ["</think>"]) == 4
    assert partial_suffix_len("abc </think>", ["</think>"]) == 0  # complete, not partial
    assert partial_suffix_len("x<", ["<a>", "<|b|>"]) == 1
    assert partial_suffix_len("", ["<a>"]) == 0


# ------------------------------------------------------------------ properties


def reference_qwen3(text: str, force: bool) -> tuple[str, str]:
    """The documented qwen3 rules, written as a one-shot split."""
    in_reasoning = force
    if text.startswith("<think>"):
        text, in_reasoning = text[len("<think>") :], True
    if not in_reasoning:
        return "", text
    m = re.search(r"</think>|<tool_call>", text)
    if m is None:
        return text.strip(), ""
    if m.group() == "</think>":
        return text[: m.start()].strip(), text[m.end() :].lstrip()
    return text[: m.start()].strip(), text[m.start() :]


QWEN3_PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "<th", "think", ">", "/",
                " ", "\n", "\n\n", "\t", "a", "Hi", "x y", "é", "🤖", "{}", "<b>"]
HARMONY_PIECES = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.f",
                  " to=browser.x", " <|constrain|>json", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
                  "<|", "|>", "<", "|", "hello", " ", "\n", '{"a": 1}', "é"]


@st.composite
def chunked(draw, pieces: list[str]):
    text = "".join(draw(st.lists(st.sampled_from(pieces), max_size=25)))
    cuts = draw(st.lists(st.integers(0, max(len(text), 1)), max_size=len(text)))
    return text, split(text, cuts)


@pytest.mark.parametrize("family", ["qwen3", "glm45"])
@FAST
@given(chunked(QWEN3_PIECES), st.booleans())
def test_think_splitters_match_reference_in_any_chunking(family, case, force):
    text, pieces = case
    # glm45 is qwen3 on the output less its leading whitespace.
    expected = reference_qwen3(text.lstrip() if family == "glm45" else text, force)
    assert non_stream(family, force, text) == expected
    assert stream(family, force, pieces) == expected
    assert stream(family, force, list(text)) == expected


@FAST
@given(chunked(HARMONY_PIECES), st.booleans())
def test_harmony_stream_equals_non_stream_and_hides_markers(case, force):
    text, pieces = case
    expected = non_stream("gpt_oss", force, text)
    assert stream("gpt_oss", force, pieces) == expected
    assert stream("gpt_oss", force, list(text)) == expected
    reasoning, content = expected
    for marker in HARMONY_MARKERS:
        assert marker not in reasoning
        # Markers reach content only inside verbatim tool blocks.
        assert "to=functions." in content or marker not in content, (marker, content)
