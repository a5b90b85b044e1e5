"""`/metrics` of a real server after a few requests: counters moved by exactly what the
responses report, histograms filled, and every name docs/server.md lists is served."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from freetoken.kernels.plan import OPS
from tests.support.servers import ROOT, Server

pytestmark = pytest.mark.slow

SHARED = "Here is a long shared preamble that both requests begin with, word for word. " * 3


def _scrape(url: str) -> dict[tuple, float]:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
            s.value for family in text_string_to_metric_families(r.text) for s in family.samples}


def _idle(url: str) -> None:
    deadline = time.time() + 30
    while time.time() < deadline:
        stats = httpx.get(f"{url}/v1/stats").json()
        if stats["frontend_requests"] == 0 and stats["engine"].get("running", 0) == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"server not idle: {stats}")


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def own_server():
    # Not a session server: another test file may leave a request in flight on one (seen with
    # the files in another order: one still counted after 30 s), and it would move the counters.
    server = Server()
    yield server
    server.stop()


def test_metrics_after_a_few_requests(own_server):
    url = own_server.url
    _idle(url)
    before = _scrape(url)
    usages, reasons = [], []
    for tail in ("Continue: one", "Continue: two"):
        body = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": SHARED + tail, "max_tokens": 5, "temperature": 0, "ignore_eos": True}).json()
        usages.append(body["usage"])
        reasons.append(body["choices"][0]["finish_reason"])
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert '"usage"' in lines[-1]
    usages.append(json.loads(lines[-1][6:])["usage"])
    reasons += [json.loads(line[6:])["choices"][0]["finish_reason"] for line in lines
                if '"finish_reason": "' in line]
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": "ten"})
    assert bad.status_code == 400
    _idle(url)
    after = _scrape(url)

    def d(name: str, **labels) -> float:
        return _delta(before, after, name, **labels)

    assert d("freetoken:http_requests_total", endpoint="/v1/completions", status="200") == 2
    assert d("freetoken:http_requests_total", endpoint="/v1/completions", status="400") == 1
    assert d("freetoken:http_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert d("freetoken:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert d("freetoken:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    for reason in set(reasons):
        assert d("freetoken:request_success_total", finished_reason=reason) == reasons.count(reason)
    assert d("freetoken:time_to_first_token_seconds_count") == 3
    assert d("freetoken:e2e_request_latency_seconds_count") == 3
    # One interval per token after the first (the engine sends one token per step).
    assert d("freetoken:inter_token_latency_seconds_count") == sum(
        u["completion_tokens"] - 1 for u in usages)
    assert d("freetoken:time_to_first_token_seconds_sum") > 0
    assert d("freetoken:e2e_request_latency_seconds_bucket", le="+Inf") == 3
    # The second completion found the first one's preamble in the prefix cache.
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert d("freetoken:prefix_cache_hits_total") >= cached > 0
    assert d("freetoken:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
    # Idle: no request holds KV (what the prefix cache keeps is evictable), none runs or waits.
    for gauge in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
        assert after[(f"freetoken:{gauge}", ())] == 0

    documented = set(re.findall(r"`(freetoken:[a-z0-9_]+)`", (ROOT / "docs/server.md").read_text()))
    # Served only with --speculative-config: tests/e2e/test_speculative_serving.py checks them.
    documented = {name for name in documented if not name.startswith("freetoken:spec_decode_")}
    served = {re.sub(r"_(bucket|count|sum)$", "", name) for name, _ in after}
    assert len(documented) >= 14 and documented <= served, documented - served
    assert {name for name in served if name.startswith("freetoken:")} <= documented


def test_kernel_choice_is_reported_and_holds(own_server):
    """/v1/stats names each layer kind's kernel and every op's (the kernel plan, also in /metrics
    and the start-up log), /metrics says whether they are all batch-invariant; where they are, a request's logprobs are the same alone and among others."""
    url = own_server.url
    engine = httpx.get(f"{url}/v1/stats").json()["engine"]
    kernels = engine["linear_kernels"]
    assert "lm_head 576x49152" in kernels and any("mlp.down_proj" in kind for kind in kernels)
    assert all(v.split()[0] in ("onednn", "torch", "grouped", "amx", "avx512_bf16", "quant_linear") for v in kernels.values())
    scraped = _scrape(url)
    assert scraped[("freetoken:batch_invariant", ())] == engine["batch_invariant"]
    # The kernel plan: every op in /v1/stats, one kernel_info series each, one start-up line.
    plan = engine["kernel_plan"]
    assert list(plan) == list(OPS) and plan["linear"] != "none" and plan["attention"] != "none"
    assert {labels for name, labels in scraped if name == "freetoken:kernel_info"} == {
        (("kernel", kernel), ("op", op)) for op, kernel in plan.items()}
    lines = [line for line in own_server.output().splitlines() if "kernel plan (" in line]
    assert len(lines) == 1 and all(f"{op}: {plan[op]}" in lines[0] for op in OPS if op != "linear")
    if not engine["batch_invariant"]:
        pytest.skip(f"no batch-invariant kernel for every shape on this CPU: {kernels}")
    body = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "logprobs": 3,
            "ignore_eos": True}

    def logprobs(reply: httpx.Response) -> list:
        return reply.json()["choices"][0]["logprobs"]["top_logprobs"]

    alone = logprobs(httpx.post(f"{url}/v1/completions", json=body, timeout=60))
    with httpx.Client(timeout=60) as client:
        others = [{**body, "prompt": f"Request {i}: " + "words " * (7 * i)} for i in range(1, 6)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(client.post, f"{url}/v1/completions", json=b) for b in [*others, body]]
            together = logprobs(futures[-1].result())
    assert together == alone
