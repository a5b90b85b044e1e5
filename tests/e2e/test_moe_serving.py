"""`freetoken serve` on the two mixture-of-experts families with their parsers: the completion
of the rendered chat prompt equals transformers' fp32 logprobs on the same folder, and chat with
logprobs (parsed) gives the same entries streamed and not, each one of those tokens."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.model_fixtures import reference_logprobs
from tests.support.scripted_logits import as_id
from tests.support.servers import Server
from tests.support.sse import chat_view, merge_chat_stream, sse

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris today? Answer briefly."}]
PARSERS = {"tiny_qwen3_moe_path": ("qwen3", "qwen3_coder"), "tiny_gpt_oss_path": ("gpt_oss", "gpt_oss")}
STEPS = 12


@pytest.fixture(scope="module", params=list(PARSERS))
def served(request):
    folder = request.getfixturevalue(request.param)
    reasoning, tools = PARSERS[request.param]
    server = Server("--model", str(folder), "--reasoning-parser", reasoning, "--tool-call-parser", tools)
    yield folder, server
    server.stop()


def test_chat_logprobs_match_transformers_streamed_or_not(served):
    folder, server = served
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompt = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    greedy = {"temperature": 0, "max_tokens": STEPS, "return_tokens_as_token_ids": True}
    r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"prompt": prompt, "logprobs": 2, "ignore_eos": True, **greedy})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    output = [as_id(t) for t in lp["tokens"]]
    ref = reference_logprobs(folder, prompt, output)
    assert ref[:-1].argmax(-1).tolist() == output
    for step, (token, value, top) in enumerate(zip(output, lp["token_logprobs"], lp["top_logprobs"])):
        assert abs(ref[step, token].item() - value) <= 1e-4
        assert all(abs(ref[step, as_id(t)].item() - v) <= 1e-4 for t, v in top.items())

    body = {"messages": MESSAGES, "tools": TOOLS, "logprobs": True, "top_logprobs": 2,
            "include_reasoning_logprobs": True, **greedy}
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    assert whole["usage"]["prompt_tokens"] == len(prompt)  # the template rendered as here
    view = chat_view(whole["choices"][0])
    streamed = merge_chat_stream(sse(server, "/v1/chat/completions", body))
    view.pop("call_ids"), streamed.pop("call_ids")
    assert streamed == view
    # Each entry (reasoning, then content) is the completion's entry of a later output token.
    entries = view["reasoning_logprobs"] + view["logprobs"]
    assert entries
    at = 0
    for entry in entries:
        token = as_id(entry["token"])
        at = output.index(token, at) + 1
        assert entry["logprob"] == pytest.approx(lp["token_logprobs"][at - 1], abs=1e-6)
