"""Classifier-style scoring on /v1/completions against HF transformers on the same weights."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from transformers import AutoTokenizer

from tests.model_fixtures import default_folder, reference_logprobs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(server):
    """The default model, no flags."""
    return server()


QUESTIONS = [
    "Is the sky blue? Answer Yes or No:",
    "Is fire cold? Answer Yes or No:",
    "Do fish swim? Answer Yes or No:",
    "Is 2 + 2 = 5? Answer Yes or No:",
    "Is Paris in France? Answer Yes or No:",
    "Can pigs fly? Answer Yes or No:",
    "Is water wet? Answer Yes or No:",
    "Is the moon made of cheese? Answer Yes or No:",
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(default_folder())


@pytest.fixture(scope="module")
def labels(tok):
    yes, no = (tok.encode(w, add_special_tokens=False) for w in (" Yes", " No"))
    assert len(yes) == len(no) == 1
    return yes[0], no[0]


def _body(prompt, labels, **kw):
    return {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 2,
            "allowed_token_ids": list(labels), "return_tokens_as_token_ids": True, **kw}


def _check(choice, prompt_ids, labels, greedy=True):
    """The label, its key format, and renormalised values against HF's log-softmax."""
    lp = choice["logprobs"]
    keys = {f"token_id:{t}" for t in labels}
    assert lp["tokens"][0] in keys
    top = lp["top_logprobs"][0]
    assert set(top) == keys
    assert abs(sum(math.exp(v) for v in top.values()) - 1) <= 1e-6
    ref = reference_logprobs(default_folder(), prompt_ids, [])[0]
    norm = torch_logsumexp([ref[t].item() for t in labels])
    for t in labels:
        assert abs(top[f"token_id:{t}"] - (ref[t].item() - norm)) <= 1e-4
    if greedy:
        best = max(labels, key=lambda t: ref[t].item())
        assert lp["tokens"][0] == f"token_id:{best}"


def torch_logsumexp(values):
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))


def test_yes_no_with_httpx(default_server, tok, labels):
    prompt = QUESTIONS[0]
    r = httpx.post(f"{default_server.url}/v1/completions", json=_body(prompt, labels), timeout=60)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    _check(choice, tok.encode(prompt), labels)
    assert choice["text"] in (" Yes", " No")


def test_yes_no_with_openai_extra_body(default_server, tok, labels):
    prompt = QUESTIONS[1]
    out = default_server.client().completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, max_tokens=1, temperature=0, logprobs=2,
        extra_body={"allowed_token_ids": list(labels), "return_tokens_as_token_ids": True},
    )
    _check(out.choices[0].model_dump(), tok.encode(prompt), labels)


def test_token_id_prompt_batch(default_server, tok, labels):
    ids = [tok.encode(q) for q in QUESTIONS]
    r = httpx.post(f"{default_server.url}/v1/completions", json=_body(ids, labels), timeout=120)
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(8))
    for choice, prompt_ids in zip(body["choices"], ids):
        _check(choice, prompt_ids, labels)
    assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    assert body["usage"]["completion_tokens"] == 8


def test_sampling_at_temperature_one_stays_in_labels(default_server, tok, labels):
    for seed in range(6):
        body = _body(QUESTIONS[2], labels, temperature=1.0, seed=seed, top_k=50, top_p=0.9)
        choice = httpx.post(f"{default_server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        _check(choice, tok.encode(QUESTIONS[2]), labels, greedy=False)


def test_masked_and_unmasked_rows_in_one_batch(default_server, tok, labels):
    """Unmasked neighbours keep the raw distribution while masked rows renormalise."""
    plain = {"prompt": QUESTIONS[3], "max_tokens": 1, "temperature": 0, "logprobs": 3}

    def post(body):
        return httpx.post(f"{default_server.url}/v1/completions", json=body, timeout=60).json()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(post, [plain, _body(QUESTIONS[4], labels)] * 4))
    ref = reference_logprobs(default_folder(), tok.encode(QUESTIONS[3]), [])[0]
    for result in results[0::2]:
        lp = result["choices"][0]["logprobs"]
        token_id = tok.encode(lp["tokens"][0], add_special_tokens=False)[0]
        assert abs(lp["token_logprobs"][0] - ref[token_id].item()) <= 1e-4
        assert abs(lp["token_logprobs"][0] - ref.max().item()) <= 1e-4
    for result in results[1::2]:
        _check(result["choices"][0], tok.encode(QUESTIONS[4]), labels)


def test_echo_returns_decoded_id_prompt(default_server, tok):
    ids = tok.encode(QUESTIONS[5])
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True}
    text = httpx.post(f"{default_server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert text.startswith(QUESTIONS[5])


SCORING_ERRORS = [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [10_000_000]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [10_000_000]}, "prompt"),
    ({"prompt": [[1, -3]]}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -2}, "logprobs"),
    ({"logprobs": 1.5}, "logprobs"),
    # Structured outputs are served now: their invalid values are what is refused.
    ({"guided_json": {"type": "objet"}}, "guided_json"),
    ({"guided_regex": "a+("}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "x"}, "guided_grammar"),
    ({"guided_decoding_backend": "mystery"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),  # without a JSON spec
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"best_of": 2}, "best_of"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"min_tokens": 2}, "min_tokens"),  # more than max_tokens: 1
    ({"bad_words": [""]}, "bad_words"),
    ({"logits_processors": ["x"]}, "logits_processors"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"suffix": "end"}, "suffix"),
    ({"max_tokens": 0}, "max_tokens"),  # only with echo
    ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ({"prompt_embeds": "abc"}, "prompt_embeds"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"vllm_xargs": {"a": 1}}, "vllm_xargs"),
]


@pytest.mark.parametrize("override,param", SCORING_ERRORS)
def test_scoring_errors(default_server, labels, override, param):
    body = {**_body(QUESTIONS[0], labels), **override}
    r = httpx.post(f"{default_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(f"{default_server.url}/v1/completions", json=_body(QUESTIONS[0], labels), timeout=60)
    assert ok.status_code == 200


def test_harmless_fields_are_accepted(default_server, labels):
    body = {**_body(QUESTIONS[0], labels), "user": "u", "request_id": "r", "priority": 0,
            "add_special_tokens": True, "skip_special_tokens": True}
    assert httpx.post(f"{default_server.url}/v1/completions", json=body, timeout=60).status_code == 200


def test_logprobs_cap_message_matches_vllm(default_server):
    r = httpx.post(f"{default_server.url}/v1/completions",
                   json={"prompt": "x", "max_tokens": 1, "logprobs": 21}, timeout=60)
    assert r.json()["error"]["message"] == \
        "Requested sample logprobs of 21, which is greater than max allowed: 20"
