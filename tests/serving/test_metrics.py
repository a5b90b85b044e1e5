"""The Prometheus metrics: what the frontend observes per engine message, the engine's snapshot
read at scrape time, HTTP requests by endpoint and status, and /metrics open past the API key."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from freetoken.config import FrontendConfig
from freetoken.serving.app import create_app
from freetoken.serving.metrics import Metrics, RequestTimer


def samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels without model_name): value} of an exposition."""
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
            s.value for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(metrics: Metrics) -> dict[tuple, float]:
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain")
    return samples(body.decode())


def test_request_timings_and_tokens():
    stats: dict = {}
    metrics = Metrics("m", lambda: stats)
    a, b = RequestTimer(), RequestTimer()
    metrics.on_tokens(a, prompt_tokens=7, new_tokens=1)
    metrics.on_tokens(a, 0, 1)
    metrics.on_tokens(a, 0, 2)
    metrics.on_finish(a, "length")
    metrics.on_tokens(b, 5, 1)
    metrics.on_finish(b, "error")  # not a success, and no end-to-end latency
    s = scrape(metrics)
    assert s[("freetoken:prompt_tokens_total", ())] == 12
    assert s[("freetoken:generation_tokens_total", ())] == 5
    assert s[("freetoken:time_to_first_token_seconds_count", ())] == 2
    assert s[("freetoken:inter_token_latency_seconds_count", ())] == 2
    assert s[("freetoken:e2e_request_latency_seconds_count", ())] == 1
    assert s[("freetoken:request_success_total", (("finished_reason", "length"),))] == 1
    reasons = [dict(labels)["finished_reason"] for name, labels in s
               if name == "freetoken:request_success_total"]
    assert reasons == ["length"]
    # Every observation lands in the +Inf bucket; the first bucket is vLLM's 1 ms.
    assert s[("freetoken:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 2
    assert ("freetoken:time_to_first_token_seconds_bucket", (("le", "0.001"),)) in s
    assert s[("freetoken:engine_start_time_seconds", ())] > 1.7e9


def test_engine_gauges_and_counters_come_from_the_latest_snapshot():
    stats: dict = {}
    metrics = Metrics("m", lambda: stats)
    s = scrape(metrics)  # before the engine's first message: zeros, not missing series
    assert s[("freetoken:num_requests_running", ())] == 0
    assert s[("freetoken:kv_cache_usage_perc", ())] == 0
    stats.update(running=3, waiting=2, kv_total=200, kv_free=20, kv_used=50, preemptions=4,
                 prefix_cache_queries=100, prefix_cache_hits=60)
    s = scrape(metrics)
    assert s[("freetoken:num_requests_running", ())] == 3
    assert s[("freetoken:num_requests_waiting", ())] == 2
    assert s[("freetoken:kv_cache_usage_perc", ())] == 0.25  # held by requests, not by the cache
    assert s[("freetoken:num_preemptions_total", ())] == 4
    assert s[("freetoken:prefix_cache_queries_total", ())] == 100
    assert s[("freetoken:prefix_cache_hits_total", ())] == 60


def _client(metrics: Metrics, api_key: str | None = None, dead: bool = False) -> TestClient:
    config = FrontendConfig(served_model_name="m", max_model_len=64, vocab_size=100,
                            api_key=api_key)
    state = SimpleNamespace(config=config, dead=dead, draining=False, engine_stats={},
                            num_running=0, metrics=metrics)
    return TestClient(create_app(lambda: state), raise_server_exceptions=False)


def test_http_requests_by_endpoint_and_status_and_metrics_open_past_the_key():
    metrics = Metrics("m", dict)
    client = _client(metrics, api_key="k")
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/no/such/path").status_code == 401
    r = client.get("/metrics")  # no key: Prometheus scrapes as /health is probed
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = samples(r.text)

    def http(endpoint: str, status: str) -> float:
        return s[("freetoken:http_requests_total", (("endpoint", endpoint), ("status", status)))]

    assert http("/v1/models", "401") == http("/v1/models", "200") == 1
    # Unknown paths share one series, so random paths cannot grow the exposition.
    assert http("other", "401") == 1
    # A dead engine refuses requests, but its metrics are still served.
    assert _client(metrics, dead=True).get("/metrics").status_code == 200
