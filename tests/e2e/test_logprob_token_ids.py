"""`logprob_token_ids` through the openai SDK (extra_body), on both endpoints, against
transformers' float32 log-softmax on the same weights."""

from __future__ import annotations

import httpx
import pytest

from tests.model_fixtures import reference_logprobs, tiny_random_folder

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny_server(server):
    return server("--model", str(tiny_random_folder("qwen3")), "--dtype", "float32",
                  "--served-model-name", "tiny")


def _listed(prompt_ids: list[int]) -> list[int]:
    order = reference_logprobs(tiny_random_folder("qwen3"), prompt_ids, [])[0].argsort(descending=True)
    return [order[0].item(), order[40].item(), order[30000].item()]  # two outside the top 20


def test_completions_report_the_listed_ids_at_each_position(tiny_server):
    prompt = [1200, 3400, 560, 7800, 910, 1112]
    listed = _listed(prompt)
    out = tiny_server.client().completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0,
        extra_body={"logprob_token_ids": listed, "return_tokens_as_token_ids": True,
                    "ignore_eos": True})
    lp = out.choices[0].logprobs
    tokens = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    ref = reference_logprobs(tiny_random_folder("qwen3"), prompt, tokens)
    for step, top in enumerate(lp.top_logprobs):
        # The sampled token first, then the listed ids (vLLM's shape).
        assert list(top)[0] == lp.tokens[step]
        assert set(top) == {lp.tokens[step], *(f"token_id:{t}" for t in listed)}
        for t in listed:
            assert abs(top[f"token_id:{t}"] - ref[step, t].item()) <= TOLERANCE


def test_chat_reports_the_listed_ids_in_order(tiny_server):
    listed = [17, 48000, 3, 17]
    out = tiny_server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi there"}], max_tokens=2,
        temperature=0, logprobs=True,
        extra_body={"logprob_token_ids": listed, "return_tokens_as_token_ids": True})
    entries = out.choices[0].logprobs.content
    assert entries  # the values are checked on completions; here, the shape
    for entry in entries:
        assert [t.token for t in entry.top_logprobs] == [f"token_id:{t}" for t in listed]


@pytest.mark.parametrize("listed", [[49152], list(range(21)), []])
def test_bad_lists_are_a_400_naming_the_field(tiny_server, listed):
    r = httpx.post(f"{tiny_server.url}/v1/completions",
                   json={"prompt": "hi", "max_tokens": 1, "logprob_token_ids": listed}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids", r.text
