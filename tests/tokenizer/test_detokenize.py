"""IncrementalDetokenizer / TokenTexts against real tokenizers, built offline.

Reference semantics used below (byte-level and byte-fallback decoders, valid UTF-8 text):
- committed text after t tokens = decode(ids[:j]) for the largest j <= t not ending in U+FFFD;
- shown text = committed text minus its longest suffix that is a proper prefix of a stop
  (nothing held back with include_stop_str_in_output);
- start(i) = len(decode(ids[:j]) without trailing U+FFFDs), maximised over j <= i;
- a stop match is the one ending first in decode(all) (then the one starting first), among
  those ending after the text committed by the first min_tokens tokens (vLLM's v1 detokenizer);
- the text is cut before the match, or after it with include_stop_str_in_output.
"""

from __future__ import annotations

import json
from itertools import accumulate, combinations
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from freetoken.tokenizer import detokenize
from freetoken.tokenizer.detokenize import DetokStep, IncrementalDetokenizer, TokenTexts

FFFD = "\ufffd"
PIECES = ["Hello", " world", ",", " ", "  ", "\n", "\n\n", "\t", "é", "café", " naïve", "e\u0301", "ß", "Ω",
          "世界", "你好，", "今天", "🤖", " 😀", "👍🏽", "👨\u200d👩\u200d👧", "🇯🇵", "x=1;", "###", "</answer>", "ab"]
CORPUS = ["Hello world, this is a tiny corpus.", "The quick brown fox jumps over the lazy dog!",
          "Café naïve résumé — déjà vu.", "世界你好，今天天气很好。", "Emoji 🤖👍🏽 and 👨‍👩‍👧 family.",
          "def f(x):\n    return x * 2\n", "stop strings like ### and </answer> appear here."] * 3
QWEN_SPECIALS = {"<|im_end|>": 248046, "<tool_call>": 248058, "</tool_call>": 248059, "<think>": 248068, "</think>": 248069}


def _tiny_bytelevel() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<think>", "<| é |>"])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def _tiny_spm() -> PreTrainedTokenizerFast:
    """Llama-2-style: '▁' pieces, <0xNN> byte fallback for CJK/emoji, leading space stripped."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, limit_alphabet=40, special_tokens=["<s>", "</s>"]))
    data = json.loads(tok.to_str())
    for b in range(256):  # byte pieces must be plain vocab entries, not (skippable) added tokens
        data["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(data["model"]["vocab"]))
    data["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="session")
def toks(qwen35_tokenizer: PreTrainedTokenizerFast) -> dict[str, tuple[Any, list[str]]]:
    return {"qwen": (qwen35_tokenizer, list(QWEN_SPECIALS)),
            "bytelevel": (_tiny_bytelevel(), ["<|endoftext|>", "<| é |>"]),
            "spm": (_tiny_spm(), ["<s>", "</s>"])}


def dec(tok: Any, ids: list[int], skip: bool = True) -> str:
    return tok.decode(ids, skip_special_tokens=skip)


def run(tok: Any, ids: list[int], sizes: list[int], stops: list[str] = (), skip: bool = True, **opts: Any) -> list[DetokStep]:
    det, out, pos = IncrementalDetokenizer(tok, stops, skip, **opts), [], 0
    for k, n in enumerate([*sizes, len(ids)]):  # the last chunk takes the rest and finishes
        last = k == len(sizes) or pos + n >= len(ids)
        out.append(det.step(ids[pos : pos + n] if not last else ids[pos:], finished=last))
        pos += n
        if last or out[-1].stopped:
            return out
    return out


def holdback(text: str, stops: list[str]) -> int:
    return max((k for k in range(1, len(text) + 1) for s in stops if len(s) > k and s.startswith(text[-k:])), default=0)


def committed(tok: Any, ids: list[int], t: int, skip: bool = True) -> str:
    return dec(tok, ids[: max(j for j in range(t + 1) if not dec(tok, ids[:j], skip).endswith(FFFD))], skip)


def first_stop(full: str, stops: list[str], include: bool = False, after: int = 0) -> tuple[int, str | None]:
    """(cut, stop) of the match ending first (then starting first) and after `after` chars."""
    found = [(i + len(s), i, s) for s in stops if (i := full.find(s, max(0, after - len(s) + 1))) >= 0]
    if not found:
        return len(full), None
    end, start, stop = min(found)
    return (end if include else start), stop


def check_stream(tok: Any, ids: list[int], sizes: list[int], stops: list[str], skip: bool = True,
                 include: bool = False, min_tokens: int = 0) -> None:
    """Runs the detokenizer and checks every step against the reference semantics (module doc)."""
    steps = run(tok, ids, sizes, stops, skip, include_stop_str_in_output=include, min_tokens=min_tokens)
    full = dec(tok, ids, skip)
    live = stops if min_tokens < len(ids) else []  # a stop ends no text of the first min_tokens tokens
    cut, stop = first_stop(full, live, include, len(committed(tok, ids, min_tokens, skip)))
    # Running max: byte fallback turns a whole run of byte pieces into U+FFFDs while its last
    # character is incomplete, hiding characters that were already complete.
    starts = list(accumulate((len(dec(tok, ids[:i], skip).rstrip(FFFD)) for i in range(len(ids))), max))
    shown, released, fed = "", 0, 0
    for k, st_ in enumerate(steps):
        shown += st_.text
        released += st_.released
        fed = min(len(ids), fed + (sizes[k] if k < len(sizes) else len(ids)))
        assert full[:cut].startswith(shown)  # never shows text at/after the cut
        if st_.stopped is None and k < len(steps) - 1:  # mid-stream: exact hold-back and release
            done = committed(tok, ids, fed, skip)
            assert shown == (done if include else done[: len(done) - holdback(done, stops)])
            assert st_.dropped == 0 and released == sum(s < len(shown) for s in starts[:fed])
    assert shown == full[:cut]
    assert steps[-1].stopped == stop
    total_dropped = sum(s.dropped for s in steps)
    assert released + total_dropped == fed and (stop is not None or total_dropped == 0)
    if stop is not None:
        assert released == sum(s < cut for s in starts[:fed])
        assert dec(tok, ids[:released], skip).startswith(shown)  # released tokens cover the visible text
    else:
        assert fed == len(ids)


texts = st.lists(st.sampled_from(PIECES), min_size=1, max_size=16).map("".join)
sizes = st.lists(st.integers(0, 5), max_size=40)
HYP = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", ["qwen", "bytelevel", "spm"])
@HYP
@given(data=st.data(), skip=st.booleans())
def test_random_text_random_splits(toks: dict, name: str, data: st.DataObject, skip: bool) -> None:
    tok, specials = toks[name]
    text = data.draw(st.lists(st.sampled_from(PIECES + specials), min_size=1, max_size=16).map("".join))
    ids = tok.encode(text, add_special_tokens=False)
    check_stream(tok, ids, data.draw(sizes), [], skip)


@pytest.mark.parametrize("name", ["qwen", "bytelevel", "spm"])
@HYP
@given(data=st.data(), include=st.booleans())
def test_stop_strings(toks: dict, name: str, data: st.DataObject, include: bool) -> None:
    tok, specials = toks[name]
    text = data.draw(st.lists(st.sampled_from(PIECES + specials), min_size=1, max_size=16).map("".join))
    ids = tok.encode(text, add_special_tokens=False)
    full = dec(tok, ids)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, max(0, len(full) - 1)))
        sub = full[i : i + data.draw(st.integers(1, 6))] or "x"
        stops.append(sub if data.draw(st.booleans()) else sub + "\x00")  # a match, or a prefix-only decoy
    min_tokens = data.draw(st.sampled_from([0, 0, data.draw(st.integers(1, len(ids) + 1))]))
    check_stream(tok, ids, data.draw(sizes), stops, include=include, min_tokens=min_tokens)


@pytest.mark.parametrize("name", ["qwen", "bytelevel"])
@HYP
@given(data=st.data(), skip=st.booleans())
def test_random_ids_byte_level(toks: dict, name: str, data: st.DataObject, skip: bool) -> None:
    # Arbitrary ids give invalid UTF-8 runs; output must still equal decode(all).
    tok, _ = toks[name]
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), min_size=1, max_size=30))
    steps = run(tok, ids, data.draw(sizes), [], skip)
    assert "".join(s.text for s in steps) == dec(tok, ids, skip)
    assert sum(s.released for s in steps) == len(ids)


def test_stop_split_across_tokens_and_holdback(qwen35_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = qwen35_tokenizer.encode("Hello world again")
    det = IncrementalDetokenizer(qwen35_tokenizer, ["lo wo"])
    assert det.step(ids[:1], False) == DetokStep("Hel", 1, 0, None)  # "lo" held: may start the stop
    assert det.step(ids[1:], False) == DetokStep("", 0, 2, "lo wo")
    assert det.step(ids[:1], False).text == ""  # nothing after a stop
    det = IncrementalDetokenizer(qwen35_tokenizer, ["lo wx"])
    steps = [det.step(ids[:1], False), det.step(ids[1:2], False), det.step(ids[2:], True)]
    assert [s.text for s in steps] == ["Hel", "lo world", " again"]


@pytest.mark.parametrize("text,stops,expect", [
    ("Hello world again", ["o world", "wor"], "Hello "),  # first-ending match wins, batching-independent
    ("👍🏽 🤖😀", ["🤖"], "👍🏽 "),  # " " is complete inside a pending token: the next token starts after it
])
@pytest.mark.parametrize("size", [1, 100])
def test_stop_cases(qwen35_tokenizer: PreTrainedTokenizerFast, text: str, stops: list[str], expect: str, size: int) -> None:
    ids = qwen35_tokenizer.encode(text)
    check_stream(qwen35_tokenizer, ids, [size] * len(ids), stops)
    assert "".join(s.text for s in run(qwen35_tokenizer, ids, [size] * len(ids), stops)) == expect


@pytest.mark.parametrize("name", ["qwen", "spm"])
def test_window_trim(toks: dict, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detokenize, "_TRIM_AT", 2)  # old ids are dropped from the list every few tokens
    tok, _ = toks[name]
    ids = tok.encode("".join(PIECES) * 2, add_special_tokens=False)
    check_stream(tok, ids, [1, 3, 2] * len(ids), ["🇯🇵x", "###"])


def test_multibyte_and_special_release(qwen35_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = qwen35_tokenizer.encode("🤖")
    assert len(ids) > 1
    det = IncrementalDetokenizer(qwen35_tokenizer)
    assert det.step([QWEN_SPECIALS["<|im_end|>"], *ids[:1]], False) == DetokStep("", 0, 0, None)
    assert det.step(ids[1:], False) == DetokStep("🤖", 1 + len(ids), 0, None)
    det = IncrementalDetokenizer(qwen35_tokenizer)
    assert det.step(ids[:-1], True) == DetokStep(dec(qwen35_tokenizer, ids[:-1]), len(ids) - 1, 0, None)  # flushed as decode()


def test_prompt_context_irrelevant_for_byte_level(qwen35_tokenizer: PreTrainedTokenizerFast) -> None:
    # Why IncrementalDetokenizer takes no prompt_ids: byte-level decoding is context-free.
    prompt, out = qwen35_tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n"), qwen35_tokenizer.encode(" Hello 世界 🤖\n")
    assert dec(qwen35_tokenizer, prompt + out)[len(dec(qwen35_tokenizer, prompt)) :] == dec(qwen35_tokenizer, out)


@pytest.mark.parametrize("name", ["qwen", "bytelevel", "spm"])
@HYP
@given(data=st.data())
def test_token_bytes_rebuild_utf8(toks: dict, name: str, data: st.DataObject) -> None:
    tok, specials = toks[name]
    extra = [] if name == "spm" else specials  # spm specials interact with the prepended '▁'
    text = data.draw(st.lists(st.sampled_from(PIECES + extra), min_size=1, max_size=16).map("".join))
    ids = tok.encode(text, add_special_tokens=False)
    tt = TokenTexts.of(tok)
    joined = b"".join(tt.bytes(i) for i in ids)
    full = dec(tok, ids, skip=False)
    # spm prepends '▁' to the text and its decoder strips it again
    assert joined == (b" " + full.encode() if name == "spm" else full.encode())
    assert all(tt.text(i) == tok.decode([i]) for i in ids)


def test_token_texts_specials_and_cache(qwen35_tokenizer: PreTrainedTokenizerFast) -> None:
    tt = TokenTexts.of(qwen35_tokenizer)
    assert TokenTexts.of(qwen35_tokenizer) is tt
    assert tt.text(QWEN_SPECIALS["<think>"]) == "<think>" and tt.bytes(QWEN_SPECIALS["</tool_call>"]) == b"</tool_call>"
    assert {qwen35_tokenizer.convert_ids_to_tokens(i): i for i in QWEN_SPECIALS.values()} == QWEN_SPECIALS
    assert tt.bytes(qwen35_tokenizer.encode(" é")[0]) == " é".encode()


BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}  # GPT-2 byte-level vocab char -> byte


def completed_texts(tok: Any, ids: list[int], skip: bool) -> list[str]:
    """Reference for byte-level vocabularies, decoded by hand from the vocabulary: the text each
    token completes (bytes pile up until they decode as whole UTF-8 characters)."""
    out, pend = [], b""
    for i in ids:
        added = tok.added_tokens_decoder.get(i)
        if added is not None:  # stored verbatim, not byte-mapped
            pend += b"" if skip and added.special else added.content.encode()
        else:
            pend += bytes(BYTE_OF[c] for c in tok.convert_ids_to_tokens(i))
        try:
            out.append(pend.decode())
            pend = b""
        except UnicodeDecodeError:
            out.append("")
    return out


@pytest.mark.parametrize("name", ["qwen", "bytelevel"])
@HYP
@given(data=st.data(), skip=st.booleans())
def test_offsets_give_each_token_the_text_it_completes(toks: dict, name: str, data: st.DataObject, skip: bool) -> None:
    tok, specials = toks[name]
    text = data.draw(st.lists(st.sampled_from(PIECES + specials), min_size=1, max_size=16).map("".join))
    ids = tok.encode(text, add_special_tokens=False)
    steps = run(tok, ids, data.draw(sizes), [], skip)
    for s in steps:  # no stop strings: nothing is held back, so the shares make up the whole text
        assert len(s.offsets) == s.released and "".join(s.shares()) == s.text
    assert [p for s in steps for p in s.shares()] == completed_texts(tok, ids, skip)


def test_offsets_skip_held_back_text_of_earlier_tokens(qwen35_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = qwen35_tokenizer.encode("Hello world again")  # Hello | world | again
    det = IncrementalDetokenizer(qwen35_tokenizer, ["lo wx", "rld ag"])
    steps = [det.step(ids[:1], False), det.step(ids[1:2], False), det.step(ids[2:], True)]
    # "lo" (held back, of "Hello") comes before " world"'s share; "rld" is cut by the stop.
    assert [(s.text, s.offsets, s.shares()) for s in steps] == [
        ("Hel", (0,), ["Hel"]), ("lo wo", (2,), [" wo"]), ("", (), [])]
    assert steps[-1].stopped == "rld ag" and steps[-1].dropped == 1


def splits(n: int) -> list[list[int]]:
    """Every way to cut n tokens into consecutive steps, as `run` sizes."""
    return [[b - a for a, b in zip((0, *cuts), cuts)] for k in range(n) for cuts in combinations(range(1, n), k)]


@pytest.mark.parametrize("text,stops", [
    ("Hello world again", ["lo wo"]),  # across a token boundary, starting in text not held back
    ("Hello world again", ["o world", "wor"]),  # first-ending match wins
    ("Hello world again", ["rld", "ello"]),  # the match inside the first token
    ("👍🏽 🤖😀 done", ["😀", "🤖"]),  # ends with a character made of byte tokens
])
def test_include_stop_str_every_split(qwen35_tokenizer: PreTrainedTokenizerFast, text: str, stops: list[str]) -> None:
    ids = qwen35_tokenizer.encode(text)
    full = dec(qwen35_tokenizer, ids)
    end, stop = min((full.find(s) + len(s), s) for s in stops if s in full)
    starts = [len(dec(qwen35_tokenizer, ids[:i]).rstrip(FFFD)) for i in range(len(ids))]
    done = [0, *accumulate(map(len, completed_texts(qwen35_tokenizer, ids, True)))]  # where shares start
    shares = [full[a:b][: max(0, end - a)] for a, b, s in zip(done, done[1:], starts) if s < end]
    for sz in splits(len(ids)):
        check_stream(qwen35_tokenizer, ids, sz, stops, include=True)
        steps = run(qwen35_tokenizer, ids, sz, stops, include_stop_str_in_output=True)
        assert "".join(s.text for s in steps) == full[:end] and steps[-1].stopped == stop
        assert sum(s.released for s in steps) == sum(a < end for a in starts)  # the rest is dropped
        assert [p for s in steps for p in s.shares()] == shares  # each token's text up to the cut


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("min_tokens,stop,expect", [
    (0, "e", "H"),
    (5, "e", "Hello, my name is L"),  # the e's of the first 5 tokens end no match (vLLM's test)
    (5, "is Lee", "Hello, my name "),  # starts in the first 5 tokens' text, ends after it
    (6, "is Lee", None),  # ends in the first 6 tokens' text: never matches
    (10, "a", "Hello, my name is Lee, and I'm "),
    (12, "e", None),
])
def test_min_tokens(qwen35_tokenizer: PreTrainedTokenizerFast, include: bool, min_tokens: int, stop: str, expect: str | None) -> None:
    tok = qwen35_tokenizer
    ids = tok.encode("Hello, my name is Lee, and I'm a student")  # 12 tokens, one per word
    assert len(ids) == 12 and dec(tok, ids[:5]) == "Hello, my name is"
    full = dec(tok, ids)
    want = full if expect is None else (expect + stop if include else expect)
    for sz in ([1] * 12, [3, 4, 5], [12], [5, 1, 6], [6, 6]):
        check_stream(tok, ids, sz, [stop], include=include, min_tokens=min_tokens)
        steps = run(tok, ids, sz, [stop], include_stop_str_in_output=include, min_tokens=min_tokens)
        assert "".join(s.text for s in steps) == want
        assert steps[-1].stopped == (None if expect is None else stop)


def test_skip_special_tokens_false_keeps_specials(qwen35_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = qwen35_tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<think>\n🤖</think>ok<|im_end|>")
    assert ids[0] == qwen35_tokenizer.convert_tokens_to_ids("<|im_start|>")
    for sz in ([1] * len(ids), [len(ids)], [2, 3]):
        text = "".join(s.text for s in run(qwen35_tokenizer, ids, sz, [], skip=False))
        assert text == "<|im_start|>user\nhi<|im_end|>\n<think>\n🤖</think>ok<|im_end|>"
        assert "".join(s.text for s in run(qwen35_tokenizer, ids, sz, [])) == "user\nhi\n<think>\n🤖</think>ok"


def _tiny_wordpiece() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # puts a space before every word-initial token, specials too
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[CLS]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("name", ["wordpiece", "qwen"])
def test_spaces_between_special_tokens(toks: dict, name: str) -> None:
    tok = _tiny_wordpiece() if name == "wordpiece" else toks["qwen"][0]
    a, b = tok.convert_tokens_to_ids(["[CLS]", "[SEP]"] if name == "wordpiece" else ["<|im_start|>", "<|im_end|>"])
    ids = [a, b, *tok.encode("Hello world", add_special_tokens=False), b, a, b]
    # Reference: vLLM's fast detokenizer, DecodeStream text per token with an added token right
    # after another taken verbatim.
    stream, added, parts = DecodeStream(skip_special_tokens=False), tok.added_tokens_decoder, []
    for i, t in enumerate(ids):
        piece = stream.step(tok.backend_tokenizer, t) or ""
        parts.append(added[t].content if t in added and i and ids[i - 1] in added else piece)
    for spaces in (True, False):
        for sz in ([1] * len(ids), [len(ids)], [2, 3]):
            text = "".join(s.text for s in run(tok, ids, sz, [], skip=False, spaces_between_special_tokens=spaces))
            assert text == (dec(tok, ids, skip=False) if spaces else "".join(parts))
            assert "".join(s.text for s in run(tok, ids, sz, [], spaces_between_special_tokens=spaces)) == dec(tok, ids)
    assert ("".join(parts) == dec(tok, ids, skip=False)) == (name == "qwen")  # byte-level: no-op
