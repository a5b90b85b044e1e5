"""Whole-label scoring through `freetoken serve` on the tiny random Qwen3 (float32):
/generative_scoring (vLLM's shape, with labels of any length) and `labels` on /v1/completions,
each label's total against transformers float32 teacher-forced on the same prompt, the
renormalised values, alone against batched, the single-token case against `allowed_token_ids`,
the openai SDK through `extra_body`, and the refusals."""

from __future__ import annotations

import math

import httpx
import pytest
from transformers import AutoTokenizer

from tests.model_fixtures import reference_logprobs, tiny_random_folder

pytestmark = pytest.mark.slow

QUERY = "Review: the film was long but the ending paid off. Sentiment:"
ITEMS = [" Is it good?", " Would you watch it again?", " Rate it.", " One word:"]
# A 1-token label, two 4-token labels sharing its first token, a 2-token one sharing that too,
# and a 4-token label of other tokens.
LABELS = [[20085], [20085, 2731, 441, 2090], [20085, 2731, 418, 511], [20085, 418],
          [441, 2090, 418, 511]]


@pytest.fixture(scope="module")
def folder():
    return tiny_random_folder("qwen3")


@pytest.fixture(scope="module")
def scorer(server, folder):
    return server("--model", str(folder), "--dtype", "float32", "--served-model-name", "tiny")


def joined(folder, query: str) -> list[list[int]]:
    """Query then item, tokenized as vLLM joins them (the item without special tokens)."""
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.encode(query, add_special_tokens=True)
    return [ids + tok.encode(item, add_special_tokens=False) for item in ITEMS]


@pytest.fixture(scope="module")
def prompts(folder) -> list[list[int]]:
    return joined(folder, QUERY)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def scored(server, items: list[str], **fields) -> list[dict]:
    r = post(server, "/generative_scoring", {"query": QUERY, "items": items, **fields})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    return [w / sum(weights) for w in weights]


def test_each_label_is_its_teacher_forced_total_renormalised_over_the_set(scorer, folder,
                                                                          prompts):
    data = scored(scorer, ITEMS, labels=LABELS)
    assert [d["index"] for d in data] == list(range(len(ITEMS)))
    tok = AutoTokenizer.from_pretrained(folder)
    texts = [[tok.decode([t]) for t in label] for label in LABELS]
    for d, prompt in zip(data, prompts):
        reference = []
        for label in LABELS:
            rows = reference_logprobs(folder, prompt, label)
            reference.append(sum(rows[j, t].item() for j, t in enumerate(label)))
        got = [e["logprob"] for e in d["labels"]]
        assert got == pytest.approx(reference, abs=1e-4)
        probs = [e["prob"] for e in d["labels"]]
        assert math.fsum(probs) == pytest.approx(1.0, abs=1e-6)
        assert probs == pytest.approx(softmax(reference), abs=1e-4)
        assert d["score"] == probs[0]
        assert [e["token_ids"] for e in d["labels"]] == LABELS
        assert [e["tokens"] for e in d["labels"]] == texts


def test_each_prompt_is_prefilled_once_for_all_its_labels(scorer, folder):
    """A query no other test sends: each prompt's first label computes it, and the others find
    all of it but the last token (whose logits score their first) in the prefix cache."""
    query = "Fresh query for the cache count:"
    r = post(scorer, "/generative_scoring", {"query": query, "items": ITEMS, "labels": LABELS})
    lengths = [len(p) for p in joined(folder, query)]
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == sum(n + len(label) for n in lengths for label in LABELS)
    assert usage["prompt_tokens_details"]["cached_tokens"] == sum(
        (n - 1) * (len(LABELS) - 1) for n in lengths)


def test_a_prompt_alone_is_bit_identical_to_it_in_a_batch(scorer):
    batched = scored(scorer, ITEMS, labels=LABELS)
    for i, item in enumerate(ITEMS):
        [alone] = scored(scorer, [item], labels=LABELS)
        assert alone["labels"] == batched[i]["labels"]


def test_string_labels_are_tokenized_as_written_after_the_prompt(scorer, folder):
    tok = AutoTokenizer.from_pretrained(folder)
    words = [" Positive", " Possibly positive", " not sure at all"]
    by_text = scored(scorer, ITEMS[:1], labels=words)[0]["labels"]
    by_ids = scored(scorer, ITEMS[:1], labels=[tok.encode(w, add_special_tokens=False)
                                               for w in words])[0]["labels"]
    assert [e["label"] for e in by_text] == words
    assert [{**e, "label": None} for e in by_text] == [{**e, "label": None} for e in by_ids]


def test_length_normalize_and_apply_softmax(scorer):
    plain = scored(scorer, ITEMS[:1], labels=LABELS)[0]
    normal = scored(scorer, ITEMS[:1], labels=LABELS, length_normalize=True)[0]
    totals = [e["logprob"] for e in plain["labels"]]
    assert [e["logprob"] for e in normal["labels"]] == totals
    per_token = [t / len(label) for t, label in zip(totals, LABELS)]
    assert [e["prob"] for e in normal["labels"]] == pytest.approx(softmax(per_token), abs=1e-12)
    raw = scored(scorer, ITEMS[:1], labels=LABELS, apply_softmax=False)[0]
    assert raw["score"] == math.exp(totals[0])


def test_single_token_labels_equal_allowed_token_ids_values(scorer, prompts):
    ids = [20085, 441, 418]
    data = scored(scorer, ITEMS, label_token_ids=ids)
    for d, prompt in zip(data, prompts):
        r = post(scorer, "/v1/completions", {
            "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": len(ids),
            "allowed_token_ids": ids, "return_tokens_as_token_ids": True})
        top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
        allowed = [math.exp(top[f"token_id:{t}"]) for t in ids]
        assert [e["prob"] for e in d["labels"]] == pytest.approx(allowed, abs=1e-6)
        assert d["score"] == pytest.approx(allowed[0], abs=1e-6)


def test_completions_labels_through_the_openai_sdk(scorer, prompts):
    client = scorer.client()
    out = client.completions.create(model="tiny", prompt=[QUERY + i for i in ITEMS[:2]],
                                    max_tokens=2, temperature=0,
                                    extra_body={"labels": LABELS})
    expected = scored(scorer, ITEMS[:2], labels=LABELS)
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.model_extra["label_logprobs"] == expected[choice.index]["labels"]
        assert choice.finish_reason == "length" and choice.text
    # The completion itself is what it is without labels.
    plain = client.completions.create(model="tiny", prompt=QUERY + ITEMS[0], max_tokens=2,
                                      temperature=0)
    assert plain.choices[0].text == out.choices[0].text
    assert "label_logprobs" not in plain.choices[0].model_extra


@pytest.mark.parametrize("path,body,param", [
    ("/generative_scoring", {"labels": []}, "labels"),
    ("/generative_scoring", {"label_token_ids": []}, "label_token_ids"),
    ("/generative_scoring", {"labels": [" yes", ""]}, "labels"),
    ("/generative_scoring", {"labels": [[1], []]}, "labels"),
    ("/generative_scoring", {"labels": [" yes", " no", " yes"]}, "labels"),
    ("/generative_scoring", {"labels": [[5, 6], [7], [5, 6]]}, "labels"),
    ("/generative_scoring", {"label_token_ids": [3, 3]}, "label_token_ids"),
    ("/generative_scoring", {"label_token_ids": [49152]}, "label_token_ids"),
    ("/generative_scoring", {"labels": [[i] for i in range(65)]}, "labels"),  # --max-labels 64
    ("/generative_scoring", {"labels": [[5] * 600]}, "labels"),  # past the 512-token context
    ("/generative_scoring", {"labels": [" a"], "label_token_ids": [5]}, "labels"),
    ("/generative_scoring", {}, "labels"),
    ("/generative_scoring", {"labels": [" a"], "items": []}, "items"),
    ("/generative_scoring", {"labels": [" a"], "temperature": 0.5}, "temperature"),
    ("/v1/completions", {"labels": []}, "labels"),
    ("/v1/completions", {"labels": [" a", " a"]}, "labels"),
    ("/v1/completions", {"labels": [" a"], "stream": True}, "labels"),
])
def test_refusals_are_400s_naming_the_field(scorer, path, body, param):
    base = {"query": QUERY, "items": ITEMS[:1]} if path == "/generative_scoring" else {
        "prompt": QUERY, "max_tokens": 1}
    r = post(scorer, path, {**base, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
