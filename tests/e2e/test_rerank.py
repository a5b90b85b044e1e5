"""/rerank and /score on a tiny random Qwen3 served as Qwen3-Reranker (vLLM's flags, the
reranker template), against transformers float32's p(yes) / (p(yes) + p(no)) on the released
prompt format; the cohere SDK pointed at the server; bad input as 400s naming the field."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from tests.model_fixtures import hf_reference, tiny_random_folder
from tests.support.servers import ROOT

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4
OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
             "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
# Qwen3-Reranker's model card: the prompt around each pair, tokenized in three parts.
PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the '
          'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
          '<|im_end|>\n<|im_start|>user\n')
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QUERY = "What is the capital of China?"
DOCUMENTS = ["The capital of China is Beijing.", "Gravity is a force that attracts two bodies.",
             "Beijing is a big city in the north of China.", "Reranking is fun!",
             "Paris is the capital of France."]


@pytest.fixture(scope="module")
def reranker(server, tiny_qwen3_path):
    return server("--model", str(tiny_qwen3_path), "--dtype", "float32", "--served-model-name",
                  "reranker", "--runner", "pooling", "--hf-overrides", json.dumps(OVERRIDES),
                  "--chat-template", str(ROOT / "examples" / "qwen3_reranker.jinja"))


@pytest.fixture(scope="module")
def reference(tiny_qwen3_path, qwen35_tokenizer):
    """p(yes) / (p(yes) + p(no)) of transformers float32, as the model card computes it."""
    tok, model = qwen35_tokenizer, hf_reference(tiny_qwen3_path)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")

    def score(query: str, document: str) -> float:
        pair = f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        ids = [tok.encode(part, add_special_tokens=False) for part in (PREFIX, pair, SUFFIX)]
        with torch.no_grad():
            logits = model(torch.tensor([sum(ids, [])])).logits[0, -1].float()
        return torch.log_softmax(logits[[no, yes]], -1)[1].exp().item()

    return score


def test_rerank_matches_the_reference_and_sorts(reranker, reference):
    r = httpx.post(f"{reranker.url}/v1/rerank", timeout=120, json={
        "model": "reranker", "query": QUERY, "documents": DOCUMENTS, "top_n": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = [reference(QUERY, d) for d in DOCUMENTS]
    results = body["results"]
    assert [x["index"] for x in results] == sorted(range(5), key=lambda i: -expected[i])[:3]
    for x in results:
        assert abs(x["relevance_score"] - expected[x["index"]]) <= TOLERANCE
        assert x["document"] == {"text": DOCUMENTS[x["index"]]}
    assert body["usage"]["prompt_tokens"] > 5 * 40


def test_score_one_to_many_and_one_to_one(reranker, reference):
    many = httpx.post(f"{reranker.url}/score", timeout=120, json={
        "text_1": QUERY, "text_2": DOCUMENTS[:3]}).json()
    assert [d["index"] for d in many["data"]] == [0, 1, 2]
    for d, doc in zip(many["data"], DOCUMENTS):
        assert abs(d["score"] - reference(QUERY, doc)) <= TOLERANCE
    queries = ["Explain gravity", QUERY]
    one = httpx.post(f"{reranker.url}/score", timeout=120, json={
        "text_1": queries, "text_2": DOCUMENTS[1:3]}).json()
    for d, q, doc in zip(one["data"], queries, DOCUMENTS[1:3]):
        assert abs(d["score"] - reference(q, doc)) <= TOLERANCE


def test_cohere_sdk_rerank(reranker, reference):
    cohere = pytest.importorskip("cohere")
    client = cohere.ClientV2(api_key="none", base_url=reranker.url)
    out = client.rerank(model="reranker", query=QUERY, documents=DOCUMENTS, top_n=2)
    expected = [reference(QUERY, d) for d in DOCUMENTS]
    assert [x.index for x in out.results] == sorted(range(5), key=lambda i: -expected[i])[:2]
    assert all(math.isclose(x.relevance_score, expected[x.index], abs_tol=TOLERANCE)
               for x in out.results)


@pytest.mark.parametrize("path,body,param", [
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v2/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ("/rerank", {"query": "q", "documents": ["a"], "max_tokens_per_doc": 9}, "max_tokens_per_doc"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
])
def test_bad_input_is_a_400_naming_the_field(reranker, path, body, param):
    r = httpx.post(f"{reranker.url}{path}", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_generation_model_refuses_rerank(server):
    plain = server("--model", str(tiny_random_folder("qwen3")), "--dtype", "float32",
                   "--served-model-name", "tiny")
    r = httpx.post(f"{plain.url}/rerank", json={"query": "q", "documents": ["a"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
