"""Prompt logprobs (`echo` + `logprobs`, vLLM's `prompt_logprobs`), `/tokenizer_info` and
lm-eval's `local-completions` loglikelihood, against HF transformers on the same weights."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from tests.model_fixtures import default_folder, hf_reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(server):
    """The default model, no flags."""
    return server()


PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(default_folder())


def reference(ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at every position (row p: the distribution of token p + 1), in float64
    so the reference carries no reduction error of its own."""
    with torch.no_grad():
        logits = hf_reference(default_folder())(torch.tensor([ids])).logits[0]
    return logits.double().log_softmax(-1)


def check_prompt_entries(ids, tokens, token_logprobs, top_logprobs, k, as_ids):
    """Legacy-shape entries of an echoed prompt against `reference(ids)`."""
    ref = reference(ids)
    assert token_logprobs[0] is None and top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert abs(token_logprobs[p] - ref[p - 1, ids[p]].item()) <= 1e-4, p
        want = ref[p - 1].topk(k).indices.tolist()
        if as_ids:
            assert tokens[p] == f"token_id:{ids[p]}"
            got = {int(key.split(":")[1]): v for key, v in top_logprobs[p].items()}
            assert set(want) <= set(got) and len(got) in (k, k + 1)
            for t, v in got.items():
                assert abs(v - ref[p - 1, t].item()) <= 1e-4


@pytest.mark.parametrize("as_ids", [True, False])
def test_echo_logprobs_match_hf(default_server, tok, as_ids):
    ids = tok.encode(PROMPT)
    body = {"prompt": ids, "echo": True, "logprobs": 3, "max_tokens": 2, "temperature": 0,
            "return_tokens_as_token_ids": as_ids}
    r = httpx.post(f"{default_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 2
    assert choice["text"].startswith(tok.decode(ids))
    check_prompt_entries(ids, lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], 3, as_ids)
    # The generated tokens follow, teacher-forced by the same reference.
    out = [int(t.split(":")[1]) for t in lp["tokens"][len(ids):]] if as_ids else None
    if out:
        ref = reference(ids + out)
        for j, t in enumerate(out):
            assert abs(lp["token_logprobs"][len(ids) + j] - ref[len(ids) - 1 + j, t].item()) <= 1e-4
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_prompt_logprobs_exact_on_a_prefix_cache_hit(default_server, tok):
    """The same prefix served first without prompt logprobs (so it is cached), then with them:
    the cached positions are recomputed, never left out or stale."""
    ids = tok.encode(PROMPT + " Rome, and of Spain")
    url = f"{default_server.url}/v1/completions"
    warm = httpx.post(url, json={"prompt": ids, "max_tokens": 1}, timeout=60).json()
    assert warm["usage"]["prompt_tokens"] == len(ids)
    again = httpx.post(url, json={"prompt": ids, "max_tokens": 1}, timeout=60).json()
    assert again["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) > 0
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}
    [choice] = httpx.post(url, json=body, timeout=60).json()["choices"]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    ref = reference(ids)
    for p in range(1, len(ids)):
        position = entries[p]
        assert str(ids[p]) in position
        assert abs(position[str(ids[p])]["logprob"] - ref[p - 1, ids[p]].item()) <= 1e-4
        top = {v["rank"]: int(k) for k, v in position.items() if v["rank"] <= 2}
        assert [top[1], top[2]] == ref[p - 1].topk(2).indices.tolist()


def test_echo_with_max_tokens_zero_returns_the_prompt_only(default_server, tok):
    ids = tok.encode(PROMPT)
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    r = httpx.post(f"{default_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["text"] == PROMPT
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    stream = httpx.post(f"{default_server.url}/v1/completions", json={**body, "stream": True},
                        timeout=60)
    chunks = [line[6:] for line in stream.text.splitlines() if line.startswith("data: {")]
    texts = "".join(c["text"] for chunk in chunks for c in json.loads(chunk)["choices"])
    assert texts == PROMPT


def test_chat_prompt_logprobs_sit_beside_the_choices(default_server):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
            "prompt_logprobs": 1}
    r = httpx.post(f"{default_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    entries = out["prompt_logprobs"]
    assert entries[0] is None and len(entries) == out["usage"]["prompt_tokens"]
    assert all(1 <= len(e) <= 2 for e in entries[1:])


def test_tokenizer_info_serves_what_lm_eval_reads(default_server, tok):
    info = httpx.get(f"{default_server.url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert "tokenizer_class" in info and "vocab_file" not in info


def test_lm_eval_loglikelihood(default_server, tok):
    """lm-eval's own client (remote tokenizer, echo + logprobs) against HF's sums."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=f"{default_server.url}/v1/completions",
                             model=default_server_model(default_server),
                             tokenizer_backend="remote", max_retries=1)
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " London"),
             ("2 + 2 =", " 4")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                for i, pair in enumerate(pairs)]
    results = lm.loglikelihood(requests)
    for (context, continuation), (logprob, greedy) in zip(pairs, results):
        ctx = tok.encode(context, add_special_tokens=False)
        cont = tok.encode(continuation, add_special_tokens=False)
        ref = reference(ctx + cont)
        want = sum(ref[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))
        assert abs(logprob - want) <= 1e-3 * len(cont)
        assert greedy == all(ref[len(ctx) - 1 + j].argmax().item() == t for j, t in enumerate(cont))
    assert results[0][0] > results[1][0]  # Paris over London
    assert math.isfinite(results[2][0])


def default_server_model(server) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
