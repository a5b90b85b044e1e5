"""OutputParser's token labels and LogprobRouter, driven as generation.py drives them (each
engine step's released tokens with their text, from ReplyBuilder): hand-written labels per
parser family, agreement with the text path on random scripts, and the router's attachment
rules (streamed lists joined == the one-step list, for random engine steps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from freetoken.parsing import registry
from freetoken.parsing.family import LogprobsUnavailable
from freetoken.parsing.machine import LogprobRouter, OutputParser
from freetoken.parsing.stage import Label
from freetoken.tokenizer.detokenize import TokenTexts
from tests.parsing.support import Drive, Parser, joined

R, C, T, M, S, H = (Label.REASONING, Label.CONTENT, Label.TOOL, Label.MARKER, Label.SPECIAL,
                    Label.HIDDEN)
FAST = settings(max_examples=120, deadline=None)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
CODER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    "</tool_call>"
)
BARE = "<function=f>\n<parameter=x>\n1\n</parameter>\n</function>"
H_TOOL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>'
)


@pytest.fixture(scope="module")
def harmony(tiny_harmony_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_harmony_path))


def script(tok: Any, *segments: tuple[str, Label]) -> tuple[list[int], list[Label]]:
    """Ids of the segments encoded one by one, and each token's expected label."""
    ids: list[int] = []
    want: list[Label] = []
    for text, label in segments:
        seg = tok.encode(text, add_special_tokens=False)
        ids += seg
        want += [label] * len(seg)
    return ids, want


def classify(tok: Any, ids: list[int], reasoning: Parser, tool: Parser, force: bool) -> list[Label]:
    drive = Drive(tok, reasoning, tool, force)
    for k, i in enumerate(ids):
        drive.step([i], [None], finished=k == len(ids) - 1)
    drive.finish()
    got = drive.router.labels
    assert len(got) == len(ids)
    return got


def parsed(
    tok: Any, ids: list[int], reasoning: Parser, tool: Parser, force: bool
) -> tuple[str, str]:
    """(reasoning, message content) of the whole text at once; Harmony keeps its markers."""
    text = tok.decode(ids, skip_special_tokens=reasoning != "gpt_oss")
    step = registry.parse_text(text, reasoning, tool, [], force)
    return step.reasoning, step.content


def check(
    tok: Any, reasoning: Parser, tool: Parser, force: bool, *segments: tuple[str, Label]
) -> list[int]:
    """Labels as written, and the CONTENT/REASONING tokens' bytes equal the parsers' text."""
    ids, want = script(tok, *segments)
    got = classify(tok, ids, reasoning, tool, force)
    assert got == want, list(zip([tok.decode([i]) for i in ids], got, want))
    r, c = parsed(tok, ids, reasoning, tool, force)
    assert joined(tok, ids, got, C) == c
    assert joined(tok, ids, got, R) == r
    return ids


# ------------------------------------------------------------------ qwen3 / hermes / qwen3_coder


def test_seed_example(qwen35_tokenizer: Any) -> None:
    ids = [9764, 728, 1683, 13, 248069, 271, 9947, 264, 361, 65, 29, 4619, 13]
    assert qwen35_tokenizer.encode("Let me think.</think>\n\nUse a <b> tag.", add_special_tokens=False) == ids
    assert classify(qwen35_tokenizer, ids, "qwen3", None, True) == [R, R, R, R, M, H, C, C, C, C, C, C, C]
    # The same with a tool parser: the turn's leading whitespace is dropped either way.
    assert classify(qwen35_tokenizer, ids, "qwen3", "hermes", True) == [R, R, R, R, M, H, C, C, C, C, C, C, C]


def test_thinking_then_tool_call(qwen35_tokenizer: Any) -> None:
    check(qwen35_tokenizer, "qwen3", "hermes", True, ("\n", H), ("Weather in Paris", R), ("\n\n", R),
          ("then call", R), ("\n", H), ("</think>", M), ("\n\n", H), (CALL, T), ("<|im_end|>", S))
    # <tool_call> met while reasoning ends it (trailing whitespace dropped) and is a call...
    check(qwen35_tokenizer, "qwen3", "hermes", True, ("I should call it.", R), ("\n", H), (CALL, T))
    # ...or, with no tool parser, plain content from the tag on, verbatim.
    check(qwen35_tokenizer, "qwen3", None, True, ("I should call it.", R), ("\n", H), (CALL + "\n ok", C))


def test_tool_only_turn_has_no_content(qwen35_tokenizer: Any) -> None:
    ids = check(qwen35_tokenizer, "qwen3", "hermes", True, ("Plan", R), ("</think>", M), ("\n\n", H), (CALL, T),
                ("\n", H), (CALL2, T), ("\n\n", H), ("<|im_end|>", S))  # fmt: skip
    assert C not in classify(qwen35_tokenizer, ids, "qwen3", "hermes", True)


def test_content_then_two_calls(qwen35_tokenizer: Any) -> None:
    check(qwen35_tokenizer, None, "hermes", False, ("\n ", H), ("Checking both.", C), ("\n", C), (CALL, T),
          ("\n\n", H), (CALL2, T), ("\n", H), ("Done", C), (" \n", C))  # fmt: skip
    check(qwen35_tokenizer, "qwen3", "qwen3_coder", True, ("r", R), ("</think>", M), ("\n\n", H),
          ("One moment.", C), ("\n", C), (CODER, T), ("\n", H), (CODER, T), ("\n", H))


def test_qwen3_coder_bare_function_and_blocks_that_stay_text(qwen35_tokenizer: Any) -> None:
    check(qwen35_tokenizer, None, "qwen3_coder", False, ("Sure", C), (BARE, T), ("\n\n", H), ("ok", C))
    # "<" then "function": a partial opener the classifier holds, like the parser does.
    check(qwen35_tokenizer, None, "qwen3_coder", False, ("a ", C), ("<", T), ("function", T),
          ("=f>\n</function>", T))
    check(qwen35_tokenizer, None, "qwen3_coder", False, ("x <", C), ("func", C), (" y", C))
    # <tool_call> not followed by <function=, and a name that never arrives: text.
    check(qwen35_tokenizer, None, "qwen3_coder", False, ("<tool_call>", C), ("\n{}", C))
    check(qwen35_tokenizer, None, "hermes", False, ("<tool_call>", C), ("\nhello", C), ("</tool_call>", C))
    check(qwen35_tokenizer, None, "hermes", False, ("Hi", C), ("<tool_call>", C), ('\n{"na', C))  # length
    check(qwen35_tokenizer, None, "hermes", False, ('<tool_call>\n{"name": "f", "argu', T))  # named: a call


def test_leading_think_without_force(qwen35_tokenizer: Any) -> None:
    check(qwen35_tokenizer, "qwen3", None, False, ("<think>", M), ("\n", H), ("Hmm", R), ("\n", R), ("ok", R),
          ("\n\n", H), ("</think>", M), ("\n\n", H), ("Answer", C))  # fmt: skip
    check(qwen35_tokenizer, "qwen3", None, True, ("<think>", M), ("Hmm", R), ("</think>", M), ("4", C))
    # Not at the very start: plain text, and no marker is tracked in content.
    check(qwen35_tokenizer, "qwen3", None, False, ("  Answer ", C), ("<think>", C), (" x ", C), ("</think>", C))
    check(qwen35_tokenizer, "qwen3", None, True, ("a", R), ("</think>", M), ("b", C), ("</think>", C),
          ("<think>", C))
    check(qwen35_tokenizer, "qwen3", None, True, ("cut off while thinking", R), ("\n\n", H))


def test_rule6_thinking_off_no_tools_equals_no_parser(qwen35_tokenizer: Any) -> None:
    ids, _ = script(qwen35_tokenizer, ("\n\nUse a <b> tag.", C), ("</think>", C), ("\n<tool_call>", C),
                    ("<|im_end|>", S))
    off = classify(qwen35_tokenizer, ids, "qwen3", None, False)
    assert off == classify(qwen35_tokenizer, ids, None, None, False)
    assert off == [C] * (len(ids) - 1) + [S]
    # Every special added token is skipped by the detokenizer, not only eos and the named ones.
    check(qwen35_tokenizer, "qwen3", "hermes", False, ("Hi", C), ("<|vision_start|>", S), (" there", C))


def test_a_character_split_across_byte_tokens_is_labelled_as_one(qwen35_tokenizer: Any) -> None:
    assert len(qwen35_tokenizer.encode("🤖", add_special_tokens=False)) == 3
    # The first two byte tokens have no text of their own: they take the third one's label.
    check(qwen35_tokenizer, "qwen3", "hermes", True, ("Hmm", R), ("🤖", R), ("\n", H),
          ("</think>", M), ("\n", H), ("🤖", C), ("ok", C))
    check(qwen35_tokenizer, "qwen3", None, True, ("🤖", R), ("</think>", M), ("🤖", C))


def test_text_held_by_a_stop_string_stays_with_its_token(qwen35_tokenizer: Any) -> None:
    """" tag" shows " ta" and holds "g" (it may start the stop string "gz"); the next reply
    releases "g." with "." alone as its token: the "g" is still " tag"'s."""
    ids = qwen35_tokenizer.encode("Let me tag.</think>ok", add_special_tokens=False)
    for force, want in ((True, [R, R, R, R, M, C]), (False, [C] * 6)):
        drive = Drive(qwen35_tokenizer, "qwen3", None, force, stops=["gz"])
        steps = [drive.step([i], [k], finished=k == len(ids) - 1) for k, i in enumerate(ids)]
        steps.append(drive.finish())
        side = "reasoning" if force else "content"
        assert [getattr(s, side) for s in steps[2:4]] == [" ta", "g."]
        assert drive.router.labels == want
        got = drive.router.take(Label.REASONING if force else Label.CONTENT)
        assert got == ([0, 1, 2, 3] if force else [0, 1, 2, 3, 4, 5])


def test_router_without_parsers_routes_everything_as_content() -> None:
    parser, router = OutputParser(), LogprobRouter()
    router.add(["a"])
    router.route(parser.feed([1], "x", ["x"]).labels)
    router.add(["b"])
    router.route(parser.feed([2], "", None).labels)  # no parser: no per-token text needed
    assert router.take(Label.CONTENT) == ["a", "b"]
    router.route(parser.finish().labels)
    assert router.take(Label.CONTENT) == [] and router.take(Label.REASONING) == []


# ------------------------------------------------------------------ Harmony


def test_harmony_channels(harmony: Any) -> None:
    hdr = "<|start|>assistant<|channel|>"
    for tool in ("gpt_oss", None):
        check(harmony, "gpt_oss", tool, False, ("<|channel|>analysis<|message|>", M),
              ("think hard ", R), ("<|end|>", M), (hdr + "final<|message|>", M), ("Hi! ", C),
              ("<|return|>", M))
        check(harmony, "gpt_oss", tool, True, ("plan", R), ("<|end|>", M),
              (hdr + "commentary<|message|>", M), ("Working.", C), ("<|end|>", M))
    check(harmony, "gpt_oss", "gpt_oss", False, (hdr + "analysis<|message|>", M), ("call it", R),
          ("<|end|>", M), (H_TOOL, T), (hdr + "final<|message|>", M), ("\n ", H),
          ("It is sunny.", C))
    # Without the tool parser, a tool message is content verbatim, header and closer included.
    check(harmony, "gpt_oss", None, False, ("<|channel|>analysis<|message|>", M), ("x", R),
          ("<|end|>", M), (H_TOOL, C))
    # A tool message cut short by the next message is closed there.
    check(harmony, "gpt_oss", "gpt_oss", False,
          ('<|channel|>commentary to=functions.f<|message|>{"a": 1}', T),
          (hdr + "final<|message|>", M), ("ok", C))
    # A header closed before any body, and stray markers, are dropped.
    check(harmony, "gpt_oss", "gpt_oss", False, ("<|start|>assistant<|end|>", M),
          ("<|message|>", M), ("shown", C), ("<|constrain|>", M), ("<|call|>", M),
          (hdr + "final", M))


# ------------------------------------------------------------------ unavailable


def _tiny_tokenizer(extra: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|eos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["think about the tool call answer"] * 4, trainer)
    tok.add_tokens(extra)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")


def test_unavailable_markers_explain_why(qwen35_tokenizer: Any) -> None:
    with pytest.raises(LogprobsUnavailable) as err:
        registry.check_logprobs(_tiny_tokenizer([]), "qwen3", "hermes")
    assert err.value.reason == (
        "logprobs with --reasoning-parser qwen3 need `<think>`, `</think>` and `<tool_call>` "
        "to be single tokens in this model's vocabulary; they are not"
    )
    with pytest.raises(LogprobsUnavailable, match="; `</think>` is not$"):
        registry.check_logprobs(_tiny_tokenizer(["<think>", "<tool_call>"]), "qwen3", None)
    with pytest.raises(LogprobsUnavailable, match=r"need `<\|start\|>`, .* `<\|call\|>` to be"):
        registry.check_logprobs(qwen35_tokenizer, "gpt_oss", None)
    with pytest.raises(LogprobsUnavailable, match="need --reasoning-parser gpt_oss"):
        registry.check_logprobs(qwen35_tokenizer, None, "gpt_oss")
    registry.check_logprobs(_tiny_tokenizer([]), None, "hermes")  # tools are found in text
    qwen_like = _tiny_tokenizer(["<think>", "</think>", "<tool_call>"])
    registry.check_logprobs(qwen_like, "qwen3", None)


# ------------------------------------------------------------------ random scripts

WS = st.sampled_from(["", "\n", "\n\n", " \n"])
WORDS = st.sampled_from(["Let me think", "The user wants the weather", "2+2 is 4", "Hmm"])
TEXTS = st.sampled_from(
    ["Sure.", "Use a <b> tag.", "x < y", "Done", "</think>again", "<think>", "a <fun"]
)
CALLS = {"hermes": [CALL, CALL2], "qwen3_coder": [CODER, BARE], None: [CALL, BARE]}


@st.composite
def qwen_scripts(draw: Any) -> tuple[list[tuple[str, Label]], str | None, bool]:
    """Segments (labels unused) of a Qwen3-style turn; whitespace always its own segment."""
    tool = draw(st.sampled_from(["hermes", "qwen3_coder", None]))
    force = draw(st.booleans())
    segs: list[str] = []
    if force or draw(st.booleans()):
        segs += ["<think>"] * draw(st.booleans()) + [draw(WS)]
        for _ in range(draw(st.integers(0, 3))):
            segs += [draw(WORDS), draw(WS)]
        segs.append(draw(st.sampled_from(["</think>", "</think>", "", CALLS[tool][0]])))
    for _ in range(draw(st.integers(0, 5))):
        segs += [draw(WS), draw(st.one_of(TEXTS, st.sampled_from(CALLS[tool])))]
    segs += [draw(WS), draw(st.sampled_from(["", "<|im_end|>"]))]
    return [(s, C) for s in segs if s], tool, force


@FAST
@given(qwen_scripts())
def test_random_scripts_agree_with_text_parsers(qwen35_tokenizer: Any, case: Any) -> None:
    segments, tool, force = case
    ids, _ = script(qwen35_tokenizer, *segments)
    for reasoning in ("qwen3", None):
        labels = classify(qwen35_tokenizer, ids, reasoning, tool, force)
        r, c = parsed(qwen35_tokenizer, ids, reasoning, tool, force)
        assert joined(qwen35_tokenizer, ids, labels, C) == c
        assert joined(qwen35_tokenizer, ids, labels, R) == r


# ------------------------------------------------------------------ router


def run_stream(tok: Any, ids: list[int], cuts: list[int], reasoning: str | None, tool: str | None,
               force: bool) -> tuple[list[tuple[int, str, list[Any]]], list[Any], str]:  # fmt: skip
    """Drive ReplyBuilder + parser + router as generation.py does, one engine step per slice.

    Returns (step, delta, entries) per content delta, the rest at the finish, and the content."""
    drive = Drive(tok, reasoning, tool, force)
    bounds = sorted({0, len(ids), *(c for c in cuts if 0 < c < len(ids))})
    chunks = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        last = b == len(ids)
        # an entry: (token index, step)
        delta = drive.step(ids[a:b], [(i, k) for i in range(a, b)], finished=last).content
        if last:
            end = drive.parser.finish()
            delta += end.content
        if delta:
            chunks.append((k, delta, drive.router.take(Label.CONTENT)))
        if last:
            drive.router.route(end.labels)
    return chunks, drive.router.take(Label.CONTENT), "".join(d for _, d, _ in chunks)


@FAST
@given(qwen_scripts(), st.lists(st.integers(0, 80), max_size=30))
def test_router_streamed_equals_non_streamed(qwen35_tokenizer: Any, case: Any, cuts: list[int]) -> None:
    segments, tool, force = case
    ids, _ = script(qwen35_tokenizer, *segments)
    chunks, rest, content = run_stream(qwen35_tokenizer, ids, cuts, "qwen3", tool, force)
    one_chunks, one_rest, one_content = run_stream(qwen35_tokenizer, ids, [], "qwen3", tool, force)
    expected = [e for _, _, entries in one_chunks for e in entries] + one_rest
    streamed = [e for _, _, entries in chunks for e in entries] + rest
    assert [i for i, _ in streamed] == [i for i, _ in expected]
    assert all(step <= k for k, _, entries in chunks for _, step in entries)  # never early
    assert content == one_content
    assert b"".join(TokenTexts.of(qwen35_tokenizer).bytes(ids[i]) for i, _ in expected).decode() == content


def test_router_attaches_entries_to_the_first_delta_at_or_after_their_step(qwen35_tokenizer: Any) -> None:
    ids, _ = script(qwen35_tokenizer, ("Use", C), ("<", C), ("b", C), (" <", C), (">", C), (" ok", C))
    chunks, rest, content = run_stream(qwen35_tokenizer, ids, list(range(len(ids))), None, "hermes", False)
    assert content == "Use<b <> ok"
    # "<" may open a call: held by the parser, it goes with step 2's "<b".
    # " <" shows its space at once, so its entry goes with that delta.
    got = [(k, d, [i for i, _ in e]) for k, d, e in chunks]
    assert got == [(0, "Use", [0]), (2, "<b", [1, 2]), (3, " ", [3]), (4, "<>", [4]),
                   (5, " ok", [5])]
    assert rest == []


def test_router_leftovers_go_to_take_rest(qwen35_tokenizer: Any) -> None:
    ids, _ = script(qwen35_tokenizer, ("Use", C), (" a", C), ("<|im_end|>", S))
    drive = Drive(qwen35_tokenizer, "qwen3", "hermes", False)
    drive.step([ids[0]], ["e0"])
    assert drive.router.take(Label.CONTENT) == ["e0"]
    drive.step([ids[1]], ["e1"])  # its delta takes nothing (e.g. held by a stop string)
    drive.step([ids[2]], ["e2"], finished=True)
    drive.finish()
    assert drive.router.take(Label.CONTENT) == ["e1"] and drive.router.take(Label.CONTENT) == []
    assert drive.router.labels == [C, C, S]


def test_router_bare_function_entries_are_never_content(qwen35_tokenizer: Any) -> None:
    ids, _ = script(qwen35_tokenizer, ("Sure", C), (".", C), ("\n", C), (BARE, T), ("\n", H), ("ok", C))
    chunks, rest, content = run_stream(qwen35_tokenizer, ids, list(range(len(ids))), None, "qwen3_coder", False)
    entries = [i for _, _, e in chunks for i, _ in e] + [i for i, _ in rest]
    assert content == "Sure.\nok"
    assert entries == [0, 1, 2, len(ids) - 1]


def test_router_reasoning_entries(qwen35_tokenizer: Any) -> None:
    ids, _ = script(qwen35_tokenizer, ("Hmm", C), ("\n\n", C), ("ok", C), ("\n", C), ("</think>", C), ("A", C))
    drive = Drive(qwen35_tokenizer, "qwen3", None, True)
    for i, tid in enumerate(ids[:3]):
        drive.step([tid], [i])
    assert drive.router.take(Label.REASONING) == [0, 1, 2]
    drive.step([ids[3]], [3])  # trailing whitespace: held until visible reasoning or the end
    assert drive.router.take(Label.REASONING) == []
    drive.step([ids[4]], [4])
    drive.step([ids[5]], [5], finished=True)
    drive.finish()
    assert drive.router.take(Label.REASONING) == [] and drive.router.take(Label.CONTENT) == [5]
    assert drive.router.labels == [R, R, R, H, M, C]
