"""/v1/embeddings on a tiny random Qwen3 laid out as Qwen3-Embedding (last-token pooling,
Normalize), against transformers float32; through the openai SDK (float, base64, dimensions)
and LangChain's OpenAIEmbeddings; batched == alone bit for bit; bad input as 400s."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
import torch

from tests.model_fixtures import tiny_random_folder

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hi"]


@pytest.fixture(scope="module")
def embedder(server, tiny_qwen3_embedding_path):
    return server("--model", str(tiny_qwen3_embedding_path), "--dtype", "float32",
                  "--served-model-name", "emb", "--runner", "pooling",
                  "--hf-overrides", '{"is_matryoshka": true}')


@pytest.fixture(scope="module")
def reference(tiny_qwen3_embedding_path):
    """sentence-transformers' Qwen3-Embedding pipeline by hand: tokenize (EOS appended), last
    hidden state of the last token, L2-normalised; `dims` cuts before normalising."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_embedding_path)
    model = AutoModel.from_pretrained(tiny_qwen3_embedding_path, dtype=torch.float32).eval()

    def embed(item, dims: int | None = None) -> torch.Tensor:
        ids = tok(item)["input_ids"] if isinstance(item, str) else item
        with torch.no_grad():
            state = model(torch.tensor([ids])).last_hidden_state[0, -1].float()
        return torch.nn.functional.normalize(state[:dims] if dims else state, dim=0)

    return embed


def _close(got, expected: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=0)
    assert torch.cosine_similarity(got, expected, dim=0) >= 0.99999


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_openai_sdk_embeddings(embedder, reference, encoding_format):
    """None: the SDK's default, which asks for base64 and decodes it itself."""
    kw = {"encoding_format": encoding_format} if encoding_format else {}
    out = embedder.client().embeddings.create(model="emb", input=TEXTS, **kw)
    assert [d.index for d in out.data] == [0, 1, 2]
    for d, text in zip(out.data, TEXTS):
        vector = d.embedding
        if encoding_format == "base64":  # little-endian float32, as OpenAI's
            raw = base64.b64decode(vector)
            vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert len(vector) == 64
        _close(vector, reference(text))
    assert out.usage.prompt_tokens > 2 * len(TEXTS)


def test_dimensions_cut_then_renormalise(embedder, reference):
    out = embedder.client().embeddings.create(model="emb", input=TEXTS[0], dimensions=32)
    assert len(out.data[0].embedding) == 32
    _close(out.data[0].embedding, reference(TEXTS[0], 32))


def test_token_id_inputs_and_batch_invariance(embedder, reference):
    ids = [[14556, 1814, 248044], [9707, 11, 1879, 248044, 12]]
    url = f"{embedder.url}/v1/embeddings"
    for batch in (ids, TEXTS):
        together = httpx.post(url, json={"input": batch}, timeout=60).json()["data"]
        for d, item in zip(together, batch):
            alone = httpx.post(url, json={"input": item}, timeout=60).json()["data"][0]
            assert d["embedding"] == alone["embedding"]  # bit for bit
            _close(d["embedding"], reference(item))


def test_langchain_openai_embeddings(embedder, reference):
    from langchain_openai import OpenAIEmbeddings

    lc = OpenAIEmbeddings(model="emb", base_url=f"{embedder.url}/v1", api_key="none",
                          check_embedding_ctx_length=False)
    for got, text in zip(lc.embed_documents(TEXTS[:2]), TEXTS):
        _close(got, reference(text))
    _close(lc.embed_query(TEXTS[2]), reference(TEXTS[2]))


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": [[1, 2], []]}, "input"),
    ({"input": [248320]}, "input"), ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 65}, "dimensions"), ({"input": "x", "truncate": 3}, "truncate"),
])
def test_bad_input_is_a_400_naming_the_field(embedder, body, param):
    r = httpx.post(f"{embedder.url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_wrong_model_and_generation_models(embedder, server):
    r = httpx.post(f"{embedder.url}/v1/embeddings", json={"input": "x", "model": "other"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    plain = server("--model", str(tiny_random_folder("qwen3")), "--dtype", "float32",
                   "--served-model-name", "tiny")
    r = httpx.post(f"{plain.url}/v1/embeddings", json={"input": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
