"""The client fields of vLLM's OpenAI server through `freetoken serve`: logit processing, output
controls, chat `n`, and the tool loop, each streamed and not."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.model_fixtures import default_folder
from tests.support.servers import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(server):
    """The default model, no flags."""
    return server()


PROMPT = "Write a short story about a cat who"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(default_folder())


def complete(server, **fields) -> tuple[dict, str]:
    """The non-streamed choice, after checking that the stream's text is the same."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **fields}
    url = f"{server.url}/v1/completions"
    r = httpx.post(url, json=body, timeout=120)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    streamed = httpx.post(url, json={**body, "stream": True}, timeout=120).text
    frames = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert "".join(c["text"] for f in frames for c in f["choices"]) == choice["text"]
    return choice, choice["text"]


@pytest.fixture(scope="module")
def baseline(default_server):
    return complete(default_server)[1]


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 2.0},
])
def test_penalties_change_a_repetitive_greedy_run(default_server, baseline, fields):
    _, text = complete(default_server, **fields)
    assert text != baseline


def test_logit_bias_forces_a_token(default_server, tok):
    [target] = tok.encode(" banana", add_special_tokens=False)
    choice, text = complete(default_server, logit_bias={str(target): 100}, max_tokens=3,
                            logprobs=1)
    assert text == " banana" * 3
    # Raw logprobs: the bias steers sampling, not the reported distribution.
    assert all(lp < -1 for lp in choice["logprobs"]["token_logprobs"])


def test_bad_words_keep_a_word_out(default_server, baseline):
    word = baseline.split()[0]
    _, text = complete(default_server, bad_words=[word])
    assert word not in text.split()


def test_min_tokens_holds_off_eos(default_server, tok):
    eos = tok.eos_token_id
    forced = {"logit_bias": {str(eos): 100}, "max_tokens": 8, "ignore_eos": False}
    choice, _ = complete(default_server, **forced)
    assert choice["finish_reason"] == "stop"
    held, _ = complete(default_server, min_tokens=5, **forced)
    assert held["finish_reason"] == "stop"
    r = httpx.post(f"{default_server.url}/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logit_bias": {str(eos): 100},
        "min_tokens": 5}, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 6  # five held, then the EOS


def test_include_stop_str_in_output(default_server, baseline):
    stop = baseline.split()[2]
    _, cut = complete(default_server, stop=[stop])
    _, kept = complete(default_server, stop=[stop], include_stop_str_in_output=True)
    assert stop not in cut and kept == cut + stop
    assert baseline.startswith(kept)


def test_skip_special_tokens_false_keeps_them(default_server, tok):
    special = tok.convert_tokens_to_ids("<|im_start|>")
    forced = {"logit_bias": {str(special): 100}, "max_tokens": 2}
    _, skipped = complete(default_server, **forced)
    _, kept = complete(default_server, skip_special_tokens=False, **forced)
    assert skipped == "" and kept == "<|im_start|>" * 2


def test_add_special_tokens_count_as_the_tokenizer_says(default_server, tok):
    for add in (True, False):
        r = httpx.post(f"{default_server.url}/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 1, "add_special_tokens": add}, timeout=60).json()
        assert r["usage"]["prompt_tokens"] == len(tok.encode(PROMPT, add_special_tokens=add))


def test_chat_n_choices_are_distinct_and_reproducible(default_server):
    client = default_server.client()
    ask = dict(model=None, messages=[{"role": "user", "content": "Name a colour."}],
               n=3, temperature=1.0, seed=11, max_tokens=8)
    first = client.chat.completions.create(**ask)
    again = client.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1
    stream = client.chat.completions.create(**ask, stream=True,
                                            stream_options={"include_usage": True})
    merged, usage = {}, None
    for chunk in stream:
        for c in chunk.choices:
            merged[c.index] = merged.get(c.index, "") + (c.delta.content or "")
        usage = chunk.usage or usage
    assert [merged[i] for i in range(3)] == texts
    assert usage.completion_tokens == first.usage.completion_tokens
    assert usage.prompt_tokens == first.usage.prompt_tokens


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tool_loop_server(make_scripted_model):
    """A scripted Qwen3 model (hermes tool calls) that calls get_weather, and answers once the
    prompt holds the tool's result."""
    outputs = [
        {"trigger": "<tool_response>", "text": "Done.</think>\n\nIt is 18 degrees in Paris."},
        {"trigger": "weather", "text": 'Need it.</think>\n\n<tool_call>\n{"name": "get_weather", '
                                       '"arguments": {"city": "Paris"}}\n</tool_call>'},
    ]
    # A scripted logit far above the rest: the SDK's default sampling follows the script too.
    path = make_scripted_model(outputs, scripted_logit=40.0)
    server = Server("--model", str(path), "--tool-call-parser", "hermes")
    yield server
    server.stop()


@pytest.mark.parametrize("arguments_as", ["string", "object"])
def test_openai_sdk_tool_loop(tool_loop_server, arguments_as):
    client = tool_loop_server.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=None, messages=messages, tools=[WEATHER])
    [call] = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    turn = first.choices[0].message.model_dump(exclude_none=True)
    turn["content"] = None  # as the SDK and LangChain send it back
    if arguments_as == "object":
        turn["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    messages += [turn, {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    if arguments_as == "object":  # the SDK types arguments as a string: send it raw
        r = httpx.post(f"{tool_loop_server.url}/v1/chat/completions",
                       json={"messages": messages, "tools": [WEATHER]}, timeout=60)
        assert r.status_code == 200, r.text
        final = r.json()["choices"][0]["message"]["content"]
    else:
        final = client.chat.completions.create(model=None, messages=messages, tools=[WEATHER]
                                               ).choices[0].message.content
    assert final == "It is 18 degrees in Paris."


def test_anyjev_tacit_adaptive_escalates(default_server):
    """anyjev's own Tacit client, adaptive: some decisions go to a reasoning pass, which sends
    include_stop_str_in_output and skip_special_tokens; the rest stay one-forward."""
    from anyjev import Tacit

    model = httpx.get(f"{default_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    tacit = Tacit.from_pretrained(str(default_folder()), engine="server",
                                  base_url=default_server.url, served_model=model,
                                  adaptive=True, tau=1e9, max_cot_share=0.5, cot_window=None,
                                  cot_max_tokens=16)
    items = [dict(state="The sky is blue.", question="What colour is the sky?",
                  options=["blue", "green"]),
             dict(state="Fire is hot.", question="Is fire hot?", kind="yes_no"),
             dict(state="", question="Pick a number.", options=["one", "two", "three"]),
             dict(state="Water is wet.", question="Is water dry?", kind="yes_no")]
    out = tacit.decide_batch(items)
    routes = [d["route"] for d in out]
    assert routes.count("cot") == 2 and routes.count("one_forward") == 2
    for item, d in zip(items, out):
        assert abs(sum(d["probs"].values()) - 1) < 1e-6
        if d["route"] == "cot":
            assert 0 < d["reasoning_tokens"] <= 17


def test_anyjev_vllm_backend(default_server, tok):
    from anyjev.backends.vllm import VLLMBackend

    from tests.model_fixtures import reference_logprobs

    model = httpx.get(f"{default_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    backend = VLLMBackend(default_server.url, model, tokenizer_name=str(default_folder()))
    labels = [tok.encode(w, add_special_tokens=False)[0] for w in (" Yes", " No")]
    prompt = "Is the sky blue? Answer Yes or No:"
    [got] = backend.next_token_logprobs([prompt], [labels])
    ref = reference_logprobs(default_folder(), tok.encode(prompt), [])[0]
    norm = ref[labels].logsumexp(0)
    for value, t in zip(got, labels):
        assert abs(value - (ref[t] - norm).item()) <= 1e-4
